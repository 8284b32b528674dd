//! Redis Cluster: the keys one settlement touches must share a hash slot.

use super::connection::Connection;

use super::broker_error;
use courier_core::source::SourceError;

/// The part of a key Redis Cluster hashes: the text between the first `{`
/// and the next `}`, when that is not empty.
pub(super) fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// The hash slot of `key`, as Redis Cluster computes it: CRC16 (XMODEM) of
/// its hash tag, or of the whole key without one, modulo 16384.
pub(super) fn slot(key: &str) -> u16 {
    let hashed = hash_tag(key).unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in hashed.as_bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = match crc & 0x8000 {
                0 => crc << 1,
                _ => (crc << 1) ^ 0x1021,
            };
        }
    }
    crc % 16384
}

/// Whether the server is a Redis Cluster node.
pub(super) async fn is_cluster(con: &mut Connection) -> Result<bool, SourceError> {
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(con)
        .await
        .map_err(broker_error)?;
    Ok(info.lines().any(|line| line.trim() == "cluster_enabled:1"))
}

/// On a Redis Cluster node, the stream, `<queue>.retry` and the dead-letter
/// stream must hash to one slot: a retry and a dead letter are each one
/// transaction over two of them, which a cluster refuses across slots. A
/// queue name without a hash tag would fail on the first retry, so it is
/// refused at start instead; a dead-letter queue outside the slot is refused
/// at start and in a live policy change.
pub(super) fn slot_problem(queue: &str, dead_letter_queue: &str) -> Option<String> {
    let Some(tag) = hash_tag(queue) else {
        return Some(format!(
            "on a Redis Cluster node --queue {queue:?} has no hash tag: the stream, {queue}.retry and the dead-letter stream must share a hash slot; name the queue with one, e.g. --queue \"{{{queue}}}\""
        ));
    };
    let dlq = dead_letter_queue;
    (hash_tag(dlq) != Some(tag)).then(|| {
        format!(
            "on a Redis Cluster node the dead-letter queue {dlq:?} must carry the queue's hash tag {{{tag}}} to share its hash slot: give it the same tag, e.g. \"{{{tag}}}.dlq\""
        )
    })
}

#[cfg(test)]
mod tests {
    use super::hash_tag;

    #[test]
    fn hash_tags_follow_redis_cluster_rules() {
        assert_eq!(hash_tag("{orders}"), Some("orders"));
        assert_eq!(hash_tag("{orders}.retry"), Some("orders"));
        assert_eq!(hash_tag("app:{orders}:dlq"), Some("orders"));
        assert_eq!(hash_tag("orders"), None);
        // An empty tag hashes the whole key, as if there were none.
        assert_eq!(hash_tag("{}orders"), None);
        assert_eq!(hash_tag("{orders"), None);
        assert_eq!(hash_tag("{a}{b}"), Some("a"));
    }

    #[test]
    fn slots_are_the_ones_redis_computes() {
        use super::slot;
        // CLUSTER KEYSLOT's answers.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("somekey"), 11058);
        assert_eq!(slot("{orders}.dlq"), slot("orders"));
    }

    #[test]
    fn the_dead_letter_queue_must_share_the_queue_slot() {
        use super::slot_problem;
        assert_eq!(slot_problem("{orders}", "{orders}.dlq"), None);
        let err = slot_problem("{orders}", "orders.dlq").unwrap();
        assert!(err.contains("{orders}.dlq"), "{err}");
        let err = slot_problem("orders", "orders.dlq").unwrap();
        assert!(err.contains("\"{orders}\""), "{err}");
    }
}
