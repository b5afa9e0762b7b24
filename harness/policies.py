"""Scripted policies for the no-LLM scenarios. Each reads the agent's
conversation (what a language model would see) and picks tool calls; the
runtime, the tools and the inbox path are the real ones."""

from __future__ import annotations

import re

from agent_host.models.scripted import ContextView, Decision, call, say

CODE = re.compile(r"\b([A-Z]{3}-\d{4,})\b")


def _code(text: str) -> str:
    match = CODE.search(text)
    return match.group(1) if match else ""


def sibling_parent(view: ContextView) -> Decision:
    """Spawn B, then A with the secret from the task; finish once both reported."""
    if not view.called("spawn_agent"):
        secret = _code(view.task)
        return Decision(calls=[
            ("spawn_agent", {"agent_name": "B", "mode": "async",
                             "task": "Your sibling A will send you a code. Reply to A's message quoting the code,"
                                     " wait for A to confirm, then finish with the code you received."}),
            ("spawn_agent", {"agent_name": "A", "mode": "async",
                             "task": f"Your secret code is {secret}. Send it to your sibling B, wait for B's reply,"
                                     " confirm it to B, then finish reporting that B confirmed the code."}),
        ])
    reports = [m for m in view.inbox if m.kind == "completion"]
    if len(reports) >= 2 and not view.called("finish"):
        return call("finish", result=" | ".join(f"{m.sender_name}: {m.text}" for m in reports))
    return say("waiting for both reports")


def sibling_a(view: ContextView) -> Decision:
    """Send the secret to B; when B's reply quotes it, confirm and finish."""
    secret = _code(view.task)
    sent = view.called("send_message")
    if not sent:
        return call("send_message", to="B", text=f"Hello B, the code is {secret}.")
    my_message = sent[0].result.get("message_id")
    answer = next((m for m in view.inbox if m.kind == "reply" and m.in_reply_to == my_message), None)
    if answer is None:
        return say("waiting for B's reply")
    if not view.called("reply"):
        verdict = "confirmed" if _code(answer.text) == secret else f"wrong code {_code(answer.text)!r}"
        return call("reply", message_id=answer.message_id, text=f"{verdict}: {secret}")
    if not view.called("finish"):
        return call("finish", result=f"B confirmed {secret}" if _code(answer.text) == secret else "B got it wrong")
    return say("done")


def sibling_b(view: ContextView) -> Decision:
    """Wait (idle) for A's code; reply quoting it; finish after A confirms."""
    code_message = next((m for m in view.inbox if m.kind == "text" and _code(m.text)), None)
    if code_message is None:
        return say("waiting for A")
    replies = view.called("reply")
    if not replies:
        return call("reply", message_id=code_message.message_id, text=f"Received the code {_code(code_message.text)}.")
    mine = replies[0].result.get("message_id")
    confirmation = next((m for m in view.inbox if m.kind == "reply" and m.in_reply_to == mine), None)
    if confirmation is None:
        return say("waiting for A's confirmation")
    if not view.called("finish"):
        return call("finish", result=f"received {_code(code_message.text)} from A; A said: {confirmation.text}")
    return say("done")


SIBLING_POLICIES = {"parent": sibling_parent, "A": sibling_a, "B": sibling_b}
