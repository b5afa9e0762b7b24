"""Run a module as __main__ on uvloop's event loop (the module's own
asyncio.run picks the installed policy):

    python -m bench.with_uvloop inboxmesh.cli.main up --port 0 ...
"""

from __future__ import annotations

import asyncio
import runpy
import sys


def main() -> None:
    import uvloop

    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
