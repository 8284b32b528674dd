"""Reads the orders database and prints what was charged, as JSON: the
number of charges, orders charged more than once (must be none), and how
many deliveries the service saw and absorbed as duplicates."""

import json
import sqlite3
import sys

con = sqlite3.connect(sys.argv[1])
one = lambda sql: con.execute(sql).fetchone()[0]
print(json.dumps({
    "charges": one("SELECT COUNT(*) FROM charges"),
    "orders_charged": one("SELECT COUNT(DISTINCT order_id) FROM charges"),
    "double_charged": [row[0] for row in con.execute(
        "SELECT order_id FROM charges GROUP BY order_id HAVING COUNT(*) > 1")],
    "charged_cents": one("SELECT COALESCE(SUM(charged_cents), 0) FROM balances"),
    "duplicates_absorbed": one("SELECT COUNT(*) FROM requests WHERE outcome = 'duplicate'"),
    "rate_limited": one("SELECT COUNT(*) FROM requests WHERE outcome = 'rate-limited'"),
    "invalid": one("SELECT COUNT(*) FROM requests WHERE outcome = 'invalid'"),
}))
