//! The torture run on RabbitMQ: the shared node on 5672 (a private node
//! boots in tens of seconds, and again after every kill), so the nemesis
//! faults only courier and the app. The queues are the run's own
//! (`<queue>`, its delay tiers `<queue>.retry.<d>`, `<queue>.dlq`,
//! `<queue>.courier-key`) and are deleted afterwards. The producer
//! publishes with confirms; the checker reads every queue of the run but
//! the dead letters and the seal's key, and the dead letters through
//! courier's own dead-letter store.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

use super::{Holdings, Hostile, Produced, TortureArgs, admin_letters, message};
use crate::sources::AMQP_URL;
use crate::torture_app::{id_of, ids_in};

pub(super) fn url() -> String {
    AMQP_URL.to_string()
}

/// Declares the work queue as `courier run --create` does (a durable
/// quorum queue) by opening courier's own source once: the producer needs
/// it before courier's first start.
pub(super) async fn create_queue(queue: &str) -> anyhow::Result<()> {
    let source_url = courier::source::parse_url(&url()).map_err(anyhow::Error::msg)?;
    let mut options = courier::source::SourceOptions::new(queue);
    options.create = true;
    let source = courier::source::open(&source_url, options).await?;
    source.close().await;
    Ok(())
}

/// The run's queues and how many messages each holds, ready and
/// unacknowledged (`rabbitmqctl list_queues`: AMQP's passive declare counts
/// only the ready ones, and the tiers' names are courier's to choose).
fn queues(queue: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let out = Command::new("rabbitmqctl")
        .args(["list_queues", "-s", "name", "messages"])
        .output()
        .context("run rabbitmqctl")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl list_queues failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let prefix = format!("{queue}.");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let (name, count) = line.split_once('\t')?;
            (name == queue || name.starts_with(&prefix))
                .then(|| (name.to_string(), count.trim().parse().unwrap_or(0)))
        })
        .collect())
}

/// The queues whose messages are not settled yet: the work queue and the
/// delay tiers (not the dead letters, nor the seal's key).
fn unsettled(queue: &str, name: &str) -> bool {
    name == queue
        || name
            .strip_prefix(queue)
            .is_some_and(|rest| rest.starts_with(".retry."))
}

pub(super) async fn settled(queue: &str) -> bool {
    let queue = queue.to_string();
    tokio::task::spawn_blocking(move || {
        queues(&queue).is_ok_and(|qs| {
            qs.iter()
                .filter(|(name, _)| unsettled(&queue, name))
                .all(|(_, n)| *n == 0)
        })
    })
    .await
    .unwrap_or(false)
}

/// The ids of every message in the work queue and the tiers, read without
/// an ack on a channel that is then closed (which puts them back), and the
/// dead letters as `courier dlq list --source <source>` reads them.
pub(super) async fn holdings(queue: &str, source: &str) -> anyhow::Result<Holdings> {
    let listed = {
        let queue = queue.to_string();
        tokio::task::spawn_blocking(move || queues(&queue)).await??
    };
    let mut out = Holdings::default();
    let connection = Connection::connect(AMQP_URL, ConnectionProperties::default()).await?;
    for (name, count) in listed {
        if count == 0 || !unsettled(queue, &name) {
            continue;
        }
        let channel = connection.create_channel().await?;
        let short = ShortString::try_new(name.as_str()).map_err(anyhow::Error::msg)?;
        while let Some(got) = channel
            .basic_get(short.clone(), BasicGetOptions { no_ack: false })
            .await?
        {
            ids_in(&got.delivery.data, &mut out.pending);
            if let Some(headers) = got.delivery.properties.headers() {
                for value in headers.inner().values() {
                    if let AMQPValue::LongString(s) = value {
                        ids_in(s.as_bytes(), &mut out.pending);
                    }
                }
            }
        }
        let _ = channel.close(200, "read".into()).await;
    }
    let _ = connection.close(200, "bye".into()).await;
    out.letters = admin_letters(source, queue).await?;
    Ok(out)
}

/// Deletes every queue of the run.
pub(super) async fn cleanup(queue: &str) -> anyhow::Result<()> {
    let listed = {
        let queue = queue.to_string();
        tokio::task::spawn_blocking(move || queues(&queue)).await??
    };
    let connection = Connection::connect(AMQP_URL, ConnectionProperties::default()).await?;
    for (name, _) in listed {
        let channel = connection.create_channel().await?;
        let short = ShortString::try_new(name.as_str()).map_err(anyhow::Error::msg)?;
        let _ = channel
            .queue_delete(short, QueueDeleteOptions::default())
            .await;
        let _ = channel.close(200, "deleted".into()).await;
    }
    let _ = connection.close(200, "bye".into()).await;
    Ok(())
}

/// Message `n` as an AMQP publish: the body, `content-type` as the
/// property, every other field a header of the table by AMQP's rules (a
/// name is a short string of at most 255 bytes; a value a long string of
/// bytes, which need not be UTF-8). Persistent, with the id as
/// `message_id`.
fn publish_of(n: u64, kind: Option<Hostile>, max_body: usize) -> (Bytes, BasicProperties) {
    let mut fields = message(n, kind, max_body, true);
    let body = fields.remove(0).1;
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Ok(id) = ShortString::try_new(id_of(n)) {
        props = props.with_message_id(id);
    }
    let mut headers = FieldTable::default();
    for (name, value) in &fields {
        let name = String::from_utf8_lossy(name);
        if name.eq_ignore_ascii_case("content-type")
            && let Ok(ct) = ShortString::try_new(String::from_utf8_lossy(value).as_ref())
        {
            props = props.with_content_type(ct);
            continue;
        }
        if let Ok(name) = ShortString::try_new(name.as_ref()) {
            headers.insert(name, AMQPValue::LongString(value.to_vec().into()));
        }
    }
    (body, props.with_headers(headers))
}

/// The producer: a publish (with confirm) to the work queue at the rate,
/// each tried until the broker confirmed it.
pub(super) fn spawn_producer(
    queue: String,
    args: TortureArgs,
    produced: Arc<Mutex<Produced>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut link: Option<(Connection, lapin::Channel)> = None;
        let mut n = 0u64;
        let Ok(routing_key) = ShortString::try_new(queue.as_str()) else {
            return;
        };
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            tick.tick().await;
            let kind = Hostile::of(args.seed, n, args.hostile);
            let (body, props) = publish_of(n, kind, args.max_body);
            let give_up = Instant::now() + Duration::from_secs(60);
            loop {
                if link.as_ref().is_none_or(|(_, c)| !c.status().connected()) {
                    link = open_channel().await.ok();
                }
                let error = match &link {
                    Some((_, channel)) => {
                        let publish = async {
                            channel
                                .basic_publish(
                                    "".into(),
                                    routing_key.clone(),
                                    BasicPublishOptions {
                                        mandatory: true,
                                        immediate: false,
                                    },
                                    &body,
                                    props.clone(),
                                )
                                .await?
                                .await
                        };
                        match tokio::time::timeout(Duration::from_secs(10), publish).await {
                            Ok(Ok(Confirmation::Ack(None))) => {
                                produced.lock().unwrap().ids.push((n, kind));
                                break;
                            }
                            Ok(Ok(other)) => format!("not stored: {other:?}"),
                            Ok(Err(e)) => e.to_string(),
                            Err(_) => "no confirm within 10 s".into(),
                        }
                    }
                    None => "cannot connect".into(),
                };
                link = None;
                if produced
                    .lock()
                    .unwrap()
                    .write_failed(n, kind, error, give_up)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            n += 1;
        }
        if let Some((connection, _)) = link {
            let _ = connection.close(200, "bye".into()).await;
        }
    })
}

async fn open_channel() -> anyhow::Result<(Connection, lapin::Channel)> {
    let connection = Connection::connect(AMQP_URL, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((connection, channel))
}
