"""Enqueues N copies of a body as bench.deliver tasks: python feed.py N BODY."""

import sys

from bench_tasks import deliver

count, body = int(sys.argv[1]), sys.argv[2]
with deliver.app.producer_or_acquire() as producer:
    for _ in range(count):
        deliver.apply_async(args=[body], producer=producer)
print(f"enqueued {count}")
