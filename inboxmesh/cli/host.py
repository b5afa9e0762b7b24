"""`inboxmesh host`: an agent host that serves the sessions of the mesh's configured agents (docs/routing.md
"Hosts that serve sessions"): every session agent that routing ingress creates is claimed and run with its
configured agent's models, tools and skills, and answers on its channel. Runs until SIGINT or SIGTERM;
a restarted host resumes the sessions it ran (host.db)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc

from agent_host.config import Budget, HostConfig
from agent_host.host import Host
from agent_host.sessions import SessionHost
from inboxmesh.cli.run import AgentLabels, configured_agents, printer
from inboxmesh.client.mesh import MeshClient


async def serve(args, address: str, data_dir: Path, admin_token: str | None, ingress_token: str,
                tls: grpc.ChannelCredentials | None, stop: asyncio.Event) -> int:
    if not admin_token:
        raise ValueError("the host follows the mesh's whole event record: it needs the operator token (run it"
                         " next to `inboxmesh up`, whose mesh.json has it, or set INBOXMESH_ADMIN_TOKEN)")
    if not ingress_token:
        raise ValueError("claiming sessions needs an ingress token of the routing config: pass --ingress-token"
                         " or set INBOXMESH_INGRESS_TOKEN")
    budget = Budget(max_model_requests=args.max_requests, max_wall_time_s=args.max_seconds,
                    max_output_tokens=args.max_output_tokens)
    config = HostConfig(mesh_address=address, data_dir=Path(args.host_dir or data_dir / "sessions-host"),
                        budget=budget, tls=tls)
    started = time.time()
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(MeshClient(address, admin_token=admin_token, tls=tls,
                                                            timeout=config.call_timeout_s))
        profiles = await configured_agents(args, client, stack)
        host = await stack.enter_async_context(Host(config, profiles, client=client))
        if not args.quiet:
            host.observers.append(printer(started, AgentLabels(host, profiles)))
        await stack.enter_async_context(SessionHost(host, client, ingress_token))
        print(f"inboxmesh host: serving the sessions of {len(profiles.agents)} configured agent(s)"
              f" ({', '.join(sorted(profiles.agents))}; config {profiles.version}) on {address}", flush=True)
        await stop.wait()
    return 0
