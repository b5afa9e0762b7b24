"""Time as the mesh records it: microseconds since the Unix epoch."""

import time


def now_us() -> int:
    return time.time_ns() // 1000
