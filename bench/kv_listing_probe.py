"""The run sweeper's listing of a key-value bucket: nats-py's KeyValue.keys() against the store's own
kv.list_keys, each called many times in a row on a bucket of two keys (a nats-server from harness/nats.py).
Counts the listings that came back wrong (nats-py's answers "no keys" when the client is slow to take
what the server sent), refused, and the consumers each left on the server. Run it beside a busy machine
to see the first (two busy processes: `python3 -c "while True: pass" &`, twice).

    .venv/bin/python bench/kv_listing_probe.py [--listings 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402
from nats.js.api import KeyValueConfig, StorageType  # noqa: E402
from nats.js.errors import NoKeysError  # noqa: E402

from harness.nats import NatsNode  # noqa: E402
from services.store.jetstream import kv  # noqa: E402

KEYS = ["k1", "k2"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listings", type=int, default=1500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-listing-") as tmp, NatsNode(Path(tmp) / "nats") as node:
        nc = await nats.connect(node.url)
        js = nc.jetstream()
        for bucket in ("a", "b"):
            made = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE))
            for key in KEYS:
                await made.put(key, b"")
        conn = SimpleNamespace(js=js, kv_stream=lambda b: f"KV_{b}", kv_subject=lambda b, k: f"$KV.{b}.{k}",
                               config=SimpleNamespace(nats_timeout_s=5.0))
        nats_py = await js.key_value("a")
        for label, bucket, call in (("nats-py KeyValue.keys()", "a", nats_py.keys),
                                    ("kv.list_keys", "b", lambda: kv.list_keys(conn, "b"))):
            wrong, refused, started = 0, 0, time.monotonic()
            for _ in range(args.listings):
                try:
                    got = await call()
                except NoKeysError:
                    got = []
                except nats.errors.Error:
                    refused += 1
                    continue
                wrong += sorted(got) != KEYS
            left = (await js.stream_info(f"KV_{bucket}")).state.consumer_count
            print(f"{label}: {args.listings} listings in {time.monotonic() - started:.1f} s; wrong {wrong},"
                  f" refused {refused}, consumers left on the server {left}", flush=True)
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
