"""The Celery peer of courier: one task that POSTs a message body to the app
and fails (so that acks_late redelivers) unless the app answers 2xx.

Configured from the environment by courier-bench: BENCH_BROKER (Redis URL),
BENCH_APP (the app URL), BENCH_QUEUE (the Celery queue).
"""

import os

import requests
from celery import Celery

app = Celery("bench_tasks", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    task_acks_late=True,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ["BENCH_QUEUE"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

APP_URL = os.environ["BENCH_APP"]
# One keep-alive session per worker process, as a careful Celery user writes it.
_session = None


@app.task(name="bench.deliver")
def deliver(body):
    global _session
    if _session is None:
        _session = requests.Session()
    answer = _session.post(
        APP_URL,
        data=body.encode(),
        headers={"Content-Type": "application/octet-stream"},
        timeout=30,
    )
    answer.raise_for_status()
