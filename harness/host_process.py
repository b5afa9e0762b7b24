"""A host in a process of its own, for scenarios that kill it.

    python -m harness.host_process --mesh ADDR --data-dir DIR --task TEXT [--hold-turn N]
    python -m harness.host_process --mesh ADDR --data-dir DIR --resume

With --task it starts a top-level agent "worker" (which answers every
message) and prints `worker <agent_id> <credential>`. With --hold-turn N the
worker's model call in turn N never returns: a run stays in progress, so
messages arriving then are delivered to this host and wait, unacked, for a
turn boundary that never comes. With --resume it resumes whatever its data
directory holds and prints `resumed <agent ids>`. It runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from agent_host.config import HostConfig
from agent_host.host import Host
from agent_host.models.scripted import Decision, call, say
from harness.hosts import GatedModel, scripted_profiles


def answer_everything(view):
    if view.new:
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": f"answer to {m.text}"})
                               for m in view.new])
    return call("list_agents") if not view.results else say("idle")


async def main(args) -> None:
    model = GatedModel(answer_everything, {args.hold_turn: asyncio.Event()} if args.hold_turn else {})
    host = Host(HostConfig(mesh_address=args.mesh, data_dir=Path(args.data_dir)), scripted_profiles({"worker": model}))
    await host.start()
    if args.resume:
        print("resumed " + " ".join(host.runners), flush=True)
    else:
        runner = await host.start_task("worker", args.task)
        print(f"worker {runner.agent_id} {runner.record.credential}", flush=True)
    if args.hold_turn:
        await model.waiting.wait()
        print("holding", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--task", default="answer whoever writes")
    parser.add_argument("--hold-turn", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    asyncio.run(main(parser.parse_args()))
