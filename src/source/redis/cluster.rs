//! Redis Cluster: the keys one settlement touches must share a hash slot.

use redis::aio::ConnectionManager;

use super::broker_error;
use crate::source::{SourceError, SourceOptions};

/// The part of a key Redis Cluster hashes: the text between the first `{`
/// and the next `}`, when that is not empty.
pub(super) fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// On a Redis Cluster node, the stream, `<queue>.retry` and the dead-letter
/// stream must hash to one slot: a retry and a dead letter are each one
/// MULTI (or Lua script) over two of them, which a cluster refuses across
/// slots. A queue name without a hash tag would fail on the first retry, so
/// it is refused at start instead.
pub(super) async fn check_cluster_slots(
    con: &mut ConnectionManager,
    url: &str,
    options: &SourceOptions,
) -> Result<(), SourceError> {
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query_async(con)
        .await
        .map_err(broker_error)?;
    if !info.lines().any(|line| line.trim() == "cluster_enabled:1") {
        return Ok(());
    }
    let queue = &options.queue;
    let Some(tag) = hash_tag(queue) else {
        return Err(SourceError::Invalid(format!(
            "{} is a Redis Cluster node and --queue {queue:?} has no hash tag: the stream, {queue}.retry and the dead-letter stream must share a hash slot; name the queue with one, e.g. --queue \"{{{queue}}}\"",
            crate::source::redact(url)
        )));
    };
    let dlq = &options.dead_letter_queue;
    if hash_tag(dlq) != Some(tag) {
        return Err(SourceError::Invalid(format!(
            "{} is a Redis Cluster node and the dead-letter queue {dlq:?} does not carry the queue's hash tag {{{tag}}}: give it the same tag, e.g. \"{{{tag}}}.dlq\"",
            crate::source::redact(url)
        )));
    }
    Ok(())
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
}
