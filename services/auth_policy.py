"""Who may call which RPC of the mesh: one table from every method it serves to an authentication policy,
and the server interceptor that applies it before any handler runs.

A handler never reads credentials: it asks `authenticated()` for what the interceptor proved (the caller,
the subscribers of a stream, the routing ingress token as sent). Credentials a stream carries after its
first request (a Consume `attach`, a SendRequest's `credentials`) are proven by the same path, through
`CallAuth.prove`, which the interceptor hands the handler with the rest. A method the server serves that has no
row in the table is refused for every caller with INTERNAL / `INTERNAL` (a defect of the mesh: it names
the method and this module) and its handler never runs; tests/test_auth_policy.py fails when an RPC of the
protos has no row. A new RPC therefore goes here first.

Refusals keep the codes, reasons and texts the directory and the caller give them (UNAUTHENTICATED
MISSING_CREDENTIAL / MALFORMED_CREDENTIAL / BAD_CREDENTIAL; PERMISSION_DENIED AGENT_CREDENTIAL_REQUIRED /
NOT_ADMIN): the interceptor raises them as MeshErrors and ErrorBoundaryInterceptor, outside it, turns
them into statuses with ErrorInfo, after its own check that the request bytes decode (so undecodable
garbage stays INVALID_ARGUMENT whatever credential comes with it).
"""

from __future__ import annotations

import contextvars
import enum
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2
from inboxmesh.gateway.v1 import gateway_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import relay_pb2
from inboxmesh.registry.v1 import registry_pb2
from inboxmesh.routing.v1 import routing_pb2
from inboxmesh.runs.v1 import runs_pb2
from services import auth
from services.auth import BOUND_TO
from services.directory import Caller, Directory
from services.store.base import AgentRecord
from services.tls import certified_names

log = logging.getLogger(__name__)


class Policy(enum.Enum):
    """What a method needs before its handler runs."""

    CALLER = "an agent's credential or the admin token (authorization metadata)"
    AGENT = "an agent's credential; the admin token is PERMISSION_DENIED / AGENT_CREDENTIAL_REQUIRED"
    ADMIN = "the admin token; an agent's credential is PERMISSION_DENIED / NOT_ADMIN"
    CALLER_OR_ANONYMOUS = "a credential when one is sent, else an anonymous call (a top-level registration)"
    SUBSCRIBERS = "the credentials the request carries, one per agent, else the authorization metadata's"
    INGRESS_TOKEN = "the bearer token handed on as sent; the routing service checks it against ingress.tokens"
    PUBLIC = "nothing: no credential is read (health, reflection, route lookups)"


@dataclass(frozen=True)
class Rule:
    """One method's row: its policy and what that policy needs to know of the method."""

    policy: Policy
    action: str = ""
    """What the call does, as a refusal names it (AGENT, ADMIN)."""
    credentials_of: Callable[[Any], Sequence[str] | None] | None = None
    """SUBSCRIBERS: the credentials in the (first) request; None when that request subscribes nobody (the
    handler refuses it, e.g. a Consume whose first message is not `subscribe`)."""


CALLER = Rule(Policy.CALLER)
CALLER_OR_ANONYMOUS = Rule(Policy.CALLER_OR_ANONYMOUS)
INGRESS_TOKEN = Rule(Policy.INGRESS_TOKEN)
PUBLIC = Rule(Policy.PUBLIC)


def _subscribe_credentials(request: inbox_pb2.SubscribeRequest) -> Sequence[str]:
    return request.credentials


def _consume_credentials(first: inbox_pb2.ConsumeRequest) -> Sequence[str] | None:
    return first.subscribe.credentials if first.WhichOneof("request") == "subscribe" else None


SUBSCRIBE = Rule(Policy.SUBSCRIBERS, credentials_of=_subscribe_credentials)
CONSUME = Rule(Policy.SUBSCRIBERS, credentials_of=_consume_credentials)


def method_name(module: ModuleType, service: str, method: str) -> str:
    """The full name gRPC routes by (`/package.Service/Method`), checked against the descriptors."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    return f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"


def _service(module: ModuleType, service: str, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    return {method_name(module, service, method): rule for method, rule in rules.items()}


METHOD_POLICIES: Mapping[str, Rule] = {
    **_service(registry_pb2, "RegistryService", {
        "RegisterAgent": CALLER_OR_ANONYMOUS,  # a child with its parent's credential; a top-level agent with none
        "RegisterChildren": Rule(Policy.AGENT, action="registering children"),  # the parent's own credential
        "GetAgent": CALLER, "ResolveAgent": CALLER, "ListAgents": CALLER, "CloseAgent": CALLER}),
    **_service(runs_pb2, "SubagentRunService", {
        "EndRun": CALLER, "GetRun": CALLER, "ListRuns": CALLER,
        "SweepRuns": Rule(Policy.ADMIN, action="running the sweeper")}),
    **_service(inbox_pb2, "InboxService", {
        "Send": CALLER, "SendStream": CALLER, "Subscribe": SUBSCRIBE, "Consume": CONSUME,
        "Ack": Rule(Policy.AGENT, action="acking"),  # an agent acks its own inbox
        "GetMessageStatus": CALLER, "ListDeadLetters": CALLER}),
    **_service(events_pb2, "EventService", {"ListEvents": CALLER, "RecordEvents": CALLER, "WatchEvents": CALLER}),
    **_service(relay_pb2, "IoaRelayService", {
        "RelayStatus": CALLER, "MapAddress": CALLER, "SpaceRead": CALLER,
        "SpaceSend": Rule(Policy.AGENT, action="posting to a space")}),  # a space message is from an agent
    **_service(routing_pb2, "RoutingService", {
        "Ingress": INGRESS_TOKEN, "ClaimSession": INGRESS_TOKEN,
        "ResolveRoute": PUBLIC, "ListConfiguredAgents": PUBLIC}),  # lookups that store nothing (docs/routing.md)
    **_service(gateway_pb2, "GatewayService", {
        "ClaimGateway": Rule(Policy.ADMIN, action="claiming a gateway"),
        "Deliver": Rule(Policy.AGENT, action="delivering from a gateway")}),  # the gateway agent's own credential
    **_service(health_pb2, "Health", {"Check": PUBLIC, "Watch": PUBLIC}),
    **_service(reflection_pb2, "ServerReflection", {"ServerReflectionInfo": PUBLIC}),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": PUBLIC,  # v1: v1alpha's messages (server.py)
}
"""Every method a mesh serves, by the full name gRPC routes by, to what it needs."""


@dataclass(frozen=True)
class CallAuth:
    """What the interceptor established for one call."""

    method: str
    policy: Policy
    callers: tuple[Caller, ...] = ()
    """The authenticated callers: one, none for an anonymous call, one per credential for SUBSCRIBERS."""
    token: str | None = None
    """INGRESS_TOKEN: the bearer token as sent (None: none was sent), not yet checked."""
    peer: str = ""
    """With credentials bound (AuthInterceptor's `bind`): the identity the connection's client certificate
    proves (its common name, else its first subject alternative name); "" without one, and when nothing is
    bound."""
    prove: Callable[[Sequence[str]], Awaitable[tuple[Caller, ...]]] | None = None
    """Proves credentials the call carries later (a Consume `attach`, a SendRequest's `credentials`) as the
    first request's are: the callers, one per credential, or the refusal of the first that proves nobody.
    Set by the interceptor on every call it authenticated; use `proven`."""

    async def proven(self, credentials: Sequence[str]) -> tuple[Caller, ...]:
        """The callers these credentials prove (see `prove`)."""
        if self.prove is None:
            raise errors.Internal(f"{self.method} asked to prove credentials outside the authentication"
                                  " interceptor; see services/auth_policy.py")
        return await self.prove(credentials)

    @property
    def caller(self) -> Caller:
        """The one authenticated caller (CALLER, AGENT, ADMIN, and CALLER_OR_ANONYMOUS with a credential)."""
        if len(self.callers) != 1:
            raise errors.Internal(f"{self.method} asked for its caller, but its policy ({self.policy.name}) "
                                  f"authenticated {len(self.callers)}; see services/auth_policy.py")
        return self.callers[0]

    @property
    def agent(self) -> AgentRecord:
        """AGENT: the calling agent (the policy refused the admin token)."""
        agent = self.caller.agent
        if agent is None:
            raise errors.Internal(f"{self.method} asked for its agent, but its policy ({self.policy.name}) lets"
                                  " the admin token through; see services/auth_policy.py")
        return agent

    @property
    def caller_or_anonymous(self) -> Caller | None:
        """CALLER_OR_ANONYMOUS: the caller, or None for a call without a credential."""
        return self.callers[0] if self.callers else None


_CALL: contextvars.ContextVar[CallAuth] = contextvars.ContextVar("inboxmesh_call_auth")
"""Set by the interceptor in the call's task. grpc.aio runs every call in its own task, whose context starts
without a value, so what one call proved never reaches another."""


def authenticated() -> CallAuth:
    """What the authentication interceptor proved for the current call: the one way a handler learns who
    is calling."""
    try:
        return _CALL.get()
    except LookupError:
        raise errors.Internal("no authentication ran for this call: the handler asked who is calling outside"
                              " AuthInterceptor (a PUBLIC method?); see services/auth_policy.py") from None


def _bearer(context: grpc.aio.ServicerContext) -> str | None:
    return auth.bearer_from_metadata(context.invocation_metadata())




class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies `rules` (METHOD_POLICIES) to every call before its handler runs, and refuses a served method
    the rules do not name. Install it inside ErrorBoundaryInterceptor (see mesh_interceptors)."""

    def __init__(self, directory: Directory, rules: Mapping[str, Rule] | None = None, *, bind: bool = False):
        """rules: METHOD_POLICIES (read when the server is built) unless given. bind: an agent credential
        works only on a connection whose client certificate proves the identity the agent was registered
        from (its record's BOUND_TO), when it was registered with one."""
        self._directory = directory
        self._bind = bind
        self._rules = METHOD_POLICIES if rules is None else rules
        self._wrapped: dict[str, tuple[Any, Any]] = {}
        """method -> (the served handler, its authenticating wrapper): wrapped once, not on every call."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # not served here: gRPC answers UNIMPLEMENTED itself
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        rule = self._rules.get(method)
        if rule is None:
            return _refusing(handler, method)
        if rule.policy is Policy.PUBLIC:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary_request(handler.unary_unary, method, rule))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._unary_request(handler.unary_stream, method, rule))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._streaming_request(handler.stream_unary, method, rule))
        return handler._replace(stream_stream=self._streaming_request(handler.stream_stream, method, rule))

    # -- what each policy proves ---------------------------------------------
    async def _authenticate(self, method: str, rule: Rule, context: grpc.aio.ServicerContext,
                            credentials: Sequence[str] | None) -> CallAuth:
        policy = rule.policy
        names = certified_names(context) if self._bind else []  # read only where something is bound to it
        peer = names[0] if names else ""
        if policy is Policy.INGRESS_TOKEN:
            return CallAuth(method, policy, token=_bearer(context), peer=peer)
        if policy is Policy.SUBSCRIBERS:
            if credentials is None:
                return CallAuth(method, policy, peer=peer)
            sent: list[str | None] = [*credentials] or [_bearer(context)]  # metadata only when the request has none
            return CallAuth(method, policy, tuple([await self._caller(c, peer) for c in sent]), peer=peer)
        if policy is Policy.CALLER_OR_ANONYMOUS:
            caller = await self._directory.authenticate(_bearer(context), allow_anonymous=True)
            if caller is not None:
                self._check_bound(caller, peer)
            return CallAuth(method, policy, () if caller is None else (caller,), peer=peer)
        caller = await self._caller(_bearer(context), peer)
        if policy is Policy.AGENT:
            caller.require_agent(rule.action)
        elif policy is Policy.ADMIN and not caller.is_admin:
            raise errors.PermissionDenied(f"{rule.action} needs the admin token", reason=Reason.NOT_ADMIN)
        return CallAuth(method, policy, (caller,), peer=peer)

    async def _caller(self, credential: str | None, peer: str) -> Caller:
        caller = await self._directory.authenticate(credential)
        assert caller is not None  # only allow_anonymous answers None
        self._check_bound(caller, peer)
        return caller

    def _check_bound(self, caller: Caller, peer: str) -> None:
        """With binding on, an agent registered from a certified connection is refused on any other."""
        bound = caller.agent.metadata.get(BOUND_TO, "") if self._bind and caller.agent is not None else ""
        if bound and bound != peer and caller.agent is not None:
            shown = repr(errors.clip(peer, 128)) if peer else "none"
            raise errors.PermissionDenied(
                f"the credential of {caller.agent.agent_id} is bound to the client certificate of"
                f" {errors.clip(bound, 128)!r} it was registered from; this connection's certificate is {shown}",
                reason=Reason.CREDENTIAL_BOUND)

    async def _established(self, method: str, rule: Rule, context: grpc.aio.ServicerContext,
                           credentials: Sequence[str] | None) -> CallAuth:
        found = await self._authenticate(method, rule, context, credentials)

        async def prove(later: Sequence[str]) -> tuple[Caller, ...]:  # each as a first request's, same peer
            return tuple([await self._caller(c, found.peer) for c in later])

        return replace(found, prove=prove)

    # -- wrapping the handler, keeping its kind ------------------------------
    def _unary_request(self, behavior, method: str, rule: Rule):
        async def prove(request, context) -> None:
            credentials = rule.credentials_of(request) if rule.credentials_of is not None else None
            _CALL.set(await self._established(method, rule, context, credentials))

        if inspect.isasyncgenfunction(behavior):
            async def authenticated_stream(request, context):
                await prove(request, context)  # the call's own task: nothing to reset (see _CALL)
                async for response in behavior(request, context):
                    yield response

            return authenticated_stream

        async def authenticated_call(request, context):  # unary, or a stream written with context.write
            await prove(request, context)
            return await behavior(request, context)

        return authenticated_call

    def _streaming_request(self, behavior, method: str, rule: Rule):
        async def prove(requests: AsyncIterator, context) -> AsyncIterator:
            """Authenticates the call; returns the requests as the handler is to read them."""
            if rule.credentials_of is None:
                _CALL.set(await self._established(method, rule, context, None))
                return requests
            try:
                first = await anext(requests)
            except StopAsyncIteration:  # nothing sent: the handler sees an empty stream
                _CALL.set(CallAuth(method, rule.policy))
                return requests
            _CALL.set(await self._established(method, rule, context, rule.credentials_of(first)))
            return _prepended(first, requests)

        if inspect.isasyncgenfunction(behavior):
            async def authenticated_stream(request_iterator, context):
                requests = await prove(request_iterator.__aiter__(), context)
                async for response in behavior(requests, context):
                    yield response

            return authenticated_stream

        async def authenticated_call(request_iterator, context):
            return await behavior(await prove(request_iterator.__aiter__(), context), context)

        return authenticated_call


async def _prepended(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def _refusing(handler, method: str):
    """The handler for a served method without a rule: every call is refused, none reaches the servicer."""

    async def refuse(request_or_iterator, context):
        log.error("%s has no authentication policy; refusing the call (add it to METHOD_POLICIES in"
                  " services/auth_policy.py)", method)
        raise errors.Internal(f"{method} has no authentication policy on this mesh, so it is refused to every"
                              " caller; this is a defect of the mesh (services/auth_policy.py)",
                              reason=Reason.INTERNAL)

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return handler._replace(**{kind: refuse})
    return handler
