#!/usr/bin/env python3
"""What a read costs the Redis server: a plain XREADGROUP against the same read inside
the smallest Lua script and inside courier's own read script (crates/redis/src/poison.rs),
from INFO commandstats (server microseconds, not the client's). Needs redis-py
(pip install redis) and the Redis on 127.0.0.1:6379. Usage: redis_read_cost.py [COUNT]."""
import re, redis, sys
import pathlib
src = (pathlib.Path(__file__).resolve().parents[2] / 'crates/redis/src/poison.rs').read_text()
def const(name):
    return re.search(r'const %s: &str = r"(.*?)";' % name, src, re.S).group(1)
full = const('SHARED') + "\n" + const('READ')
minimal = """local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if not reply then return {} end
return reply[1][2]"""
r = redis.Redis()
N = 20000; COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 4
body = 'x' * 256
def fill(key):
    r.delete(key)
    p = r.pipeline(transaction=False)
    for i in range(N):
        p.xadd(key, {'payload': body})
        if i % 1000 == 999: p.execute()
    p.execute()
    r.xgroup_create(key, 'g', id='0')
def stats():
    s = r.info('commandstats')
    return {k: (v['calls'], v['usec']) for k, v in s.items()}
for name in ['plain', 'minimal', 'full', 'plain', 'minimal', 'full']:
    key = 'lua-calls'
    fill(key)
    sc = None if name == 'plain' else r.register_script({'minimal': minimal, 'full': full}[name])
    r.config_resetstat()
    n = 0
    while True:
        if sc is None:
            rep = r.xreadgroup('g', 'c', {key: '>'}, count=COUNT)
            entries = rep[0][1] if rep else []
        else:
            entries = sc(keys=[key, key + '.dlq'], args=['g', 'c', COUNT, 10485760, '2026-12-01T00:00:00Z', 7800, 'a', 'b'])
        if not entries: break
        n += len(entries)
    st = stats()
    top = 'cmdstat_evalsha' if sc else 'cmdstat_xreadgroup'
    calls, usec = st[top]
    print(f"{name:8} COUNT {COUNT}: {n} msgs, {calls} calls, {usec/calls:.1f} us/call, {usec/n:.2f} us/msg")
    r.delete(key)
