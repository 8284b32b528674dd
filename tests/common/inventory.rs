//! What a broker holds for one queue, read with the broker's own client:
//! the names of the streams, keys, groups, queues, topics, subscriptions
//! or files that exist for it. The read-only commands must leave it as
//! they found it, and `courier send` may add the work queue alone.

use std::collections::BTreeSet;

use super::{BrokerKind, Fixture, RedisConnection};

/// Everything of `fixture`'s queue that exists on its broker now, as
/// `kind:name` strings (`stream:q`, `group:q/courier`, `key:q.courier-key`).
pub async fn inventory(fixture: &Fixture) -> BTreeSet<String> {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => redis(fixture).await,
        other => panic!("no inventory for {other:?} yet"),
    }
}

/// The item [`inventory`] shows for the work queue itself, which a send
/// may create.
pub fn work_queue_item(fixture: &Fixture) -> String {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => format!("stream:{}", fixture.queue),
        other => panic!("no inventory for {other:?} yet"),
    }
}

/// Every key courier derives from the queue name (they share its hash
/// slot, so this works on a Redis Cluster, where KEYS sees one node), and
/// the groups of the streams among them.
async fn redis(fixture: &Fixture) -> BTreeSet<String> {
    let url = fixture.source_arg();
    let mut con = RedisConnection::open(&url).await.expect("connect to Redis");
    let q = &fixture.queue;
    let mut found = BTreeSet::new();
    for key in [
        q.clone(),
        format!("{q}.retry"),
        format!("{q}.dlq"),
        format!("{q}.courier-key"),
    ] {
        let kind: String = ::redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut con)
            .await
            .expect("TYPE");
        match kind.as_str() {
            "none" => {}
            "stream" => {
                found.insert(format!("stream:{key}"));
                let groups: Vec<::redis::Value> = ::redis::cmd("XINFO")
                    .arg("GROUPS")
                    .arg(&key)
                    .query_async(&mut con)
                    .await
                    .expect("XINFO GROUPS");
                for group in groups {
                    let name = group_name(&group).expect("a group's name");
                    found.insert(format!("group:{key}/{name}"));
                }
            }
            other => {
                found.insert(format!("{other}:{key}"));
            }
        }
    }
    found
}

/// The `name` of one entry of `XINFO GROUPS` (a map in RESP3, a flat
/// list in RESP2).
fn group_name(group: &::redis::Value) -> Option<String> {
    let text = |v: &::redis::Value| match v {
        ::redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        ::redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match group {
        ::redis::Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some("name"))
            .and_then(|(_, v)| text(v)),
        ::redis::Value::Array(items) => items
            .chunks(2)
            .find(|pair| text(&pair[0]).as_deref() == Some("name"))
            .and_then(|pair| pair.get(1).and_then(text)),
        _ => None,
    }
}

/// Deletes what a test made of `fixture`'s queue outside the fixture's own
/// clean-up (a queue that only the test's `courier send` created).
pub async fn remove(fixture: &Fixture) {
    if let BrokerKind::Redis | BrokerKind::RedisCluster = fixture.broker {
        let mut con = RedisConnection::open(&fixture.source_arg())
            .await
            .expect("connect to Redis");
        let _: Result<i64, _> = ::redis::cmd("DEL")
            .arg(&fixture.queue)
            .query_async(&mut con)
            .await;
    }
}
