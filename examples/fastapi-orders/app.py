"""orders: a small FastAPI service that charges an order, made safe for
at-least-once delivery.

courier may deliver the same message more than once (a crash between the
app's answer and the broker's ack, a timeout, a replay from the dead-letter
queue). Every delivery of one message carries the same Idempotency-Key, so
the service records the key in a UNIQUE column *in the same SQLite
transaction as the charge*: either both are written or neither is, and a
second delivery of a charged order finds the key and answers 2xx without
charging again. At-least-once delivery plus this is effectively-once.

Answers, and what courier does with them:

- 201 charged, or 200 already charged (a duplicate): ack.
- 429 with Retry-After when the service's own rate limit is hit: courier
  retries after that long and holds new deliveries meanwhile.
- 400 (no Idempotency-Key, not JSON) or 422 (an invalid order): courier
  dead-letters it at once, with the answer in courier-response-excerpt.

Settings (environment): ORDERS_DB (SQLite file, default ./orders.db),
ORDERS_RATE_LIMIT (requests per second, 0 = none; default 0),
ORDERS_WORK_MS (simulated time talking to the payment provider; default 0).
"""

import asyncio
import json
import os
import sqlite3
import threading
import time
from datetime import datetime, timezone
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, Field, ValidationError

DB = os.environ.get("ORDERS_DB", "orders.db")
RATE_LIMIT = float(os.environ.get("ORDERS_RATE_LIMIT", "0"))
WORK_MS = int(os.environ.get("ORDERS_WORK_MS", "0"))

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    idempotency_key TEXT NOT NULL UNIQUE,
    order_id        TEXT NOT NULL,
    customer        TEXT NOT NULL,
    amount_cents    INTEGER NOT NULL,
    currency        TEXT NOT NULL,
    charged_at      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS balances (
    customer      TEXT PRIMARY KEY,
    charged_cents INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    idempotency_key TEXT,
    attempt         INTEGER,
    outcome         TEXT NOT NULL,
    at              TEXT NOT NULL
);
"""


class Order(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    customer: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0, le=1_000_000)
    currency: Literal["EUR", "USD", "GBP"]


def connect() -> sqlite3.Connection:
    # Autocommit mode, so that BEGIN IMMEDIATE below is the only transaction.
    con = sqlite3.connect(DB, timeout=30, isolation_level=None)
    con.execute("PRAGMA busy_timeout = 30000")
    return con


def init_db() -> None:
    con = connect()
    con.execute("PRAGMA journal_mode = WAL")
    con.executescript(SCHEMA)
    con.close()


class TokenBucket:
    """RATE_LIMIT requests per second, bursts of up to one second's worth."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = rate
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> float:
        """0 if a request may go now, else the seconds until it may."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1:
                self.tokens -= 1
                return 0.0
            return (1 - self.tokens) / self.rate


init_db()
app = FastAPI(title="orders")
bucket = TokenBucket(RATE_LIMIT) if RATE_LIMIT > 0 else None


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def log_request(con: sqlite3.Connection, key, attempt, outcome: str) -> None:
    con.execute(
        "INSERT INTO requests (idempotency_key, attempt, outcome, at) VALUES (?, ?, ?, ?)",
        (key, attempt, outcome, now()),
    )


def log_refusal(key, attempt, outcome: str) -> None:
    con = connect()
    log_request(con, key, attempt, outcome)
    con.close()


@app.get("/healthz")
def healthz():
    return {"ok": True}


@app.post("/orders")
async def charge(request: Request):
    key = request.headers.get("idempotency-key")
    attempt = request.headers.get("courier-attempt")
    if bucket is not None:
        wait = bucket.take()
        if wait > 0:
            await run_in_threadpool(log_refusal, key, attempt, "rate-limited")
            # Retry-After is whole seconds; round up so it is never 0.
            return JSONResponse(
                {"error": "rate limit; try again later"},
                status_code=429,
                headers={"Retry-After": str(max(1, int(wait + 0.999)))},
            )
    if not key:
        return JSONResponse({"error": "an Idempotency-Key header is required"}, status_code=400)
    raw = await request.body()
    try:
        order = Order.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:
        await run_in_threadpool(log_refusal, key, attempt, "invalid")
        detail = e.errors(include_url=False) if isinstance(e, ValidationError) else str(e)
        return JSONResponse({"error": "invalid order", "detail": detail}, status_code=422)
    if WORK_MS:
        # Talking to the payment provider, before anything is written.
        await asyncio.sleep(WORK_MS / 1000)
    # SQLite blocks: off the event loop, so other requests go on meanwhile.
    return await run_in_threadpool(write_charge, key, attempt, order)


def write_charge(key: str, attempt, order: Order) -> JSONResponse:
    con = connect()
    try:
        con.execute("BEGIN IMMEDIATE")
        try:
            # The key and the effect in one transaction: both or neither.
            con.execute(
                "INSERT INTO charges (idempotency_key, order_id, customer, amount_cents, currency, charged_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (key, order.order_id, order.customer, order.amount_cents, order.currency, now()),
            )
        except sqlite3.IntegrityError:
            # UNIQUE(idempotency_key): this delivery was applied before.
            con.execute("ROLLBACK")
            log_request(con, key, attempt, "duplicate")
            return JSONResponse({"status": "already charged", "order_id": order.order_id}, status_code=200)
        con.execute(
            "INSERT INTO balances (customer, charged_cents) VALUES (?, ?)"
            " ON CONFLICT(customer) DO UPDATE SET charged_cents = charged_cents + excluded.charged_cents",
            (order.customer, order.amount_cents),
        )
        log_request(con, key, attempt, "charged")
        con.execute("COMMIT")
        return JSONResponse({"status": "charged", "order_id": order.order_id}, status_code=201)
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    finally:
        con.close()
