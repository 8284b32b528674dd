//! Depth from the queues' approximate counts. SQS tells no message's age
//! without receiving it (only CloudWatch has `ApproximateAgeOfOldestMessage`),
//! so neither the oldest waiting message's age nor the oldest dead letter's
//! is reported. Read on the dead-letter store, so that the sidecar's gauges
//! and an admin handle's `depth_of` are one reading: `GetQueueUrl` and
//! `GetQueueAttributes` only, which create nothing and receive nothing.

use aws_sdk_sqs::types::QueueAttributeName;

use super::connection::queue_attributes;
use super::dead_letters::{SqsStore, dead_letter_queue_name};
use courier_core::source::{Depth, SourceError};

fn count(
    attributes: &std::collections::HashMap<QueueAttributeName, String>,
    name: QueueAttributeName,
) -> u64 {
    attributes
        .get(&name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl SqsStore {
    /// The work queue's depth with the dead letters of `dead_letter_queue`,
    /// `held` of the invisible messages being with this process's app (the
    /// rest are retries waiting, or with another replica's app). A missing
    /// work queue is an error that names it; a missing dead-letter queue
    /// holds nothing.
    pub(super) async fn depth(
        &self,
        dead_letter_queue: &str,
        held: u64,
    ) -> Result<Depth, SourceError> {
        let work = queue_attributes(&self.client, &self.work().await?.url).await?;
        let visible = count(&work, QueueAttributeName::ApproximateNumberOfMessages);
        let invisible = count(
            &work,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        );
        let delayed = count(
            &work,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        );
        let held = held.min(invisible);
        let name = dead_letter_queue_name(dead_letter_queue);
        let dead_letters = match self.dead_letter_url(&name, false).await? {
            Some(url) => {
                let dlq = queue_attributes(&self.client, &url).await?;
                count(&dlq, QueueAttributeName::ApproximateNumberOfMessages)
                    + count(
                        &dlq,
                        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                    )
                    + count(&dlq, QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            }
            None => 0,
        };
        Ok(Depth {
            ready: Some(visible),
            pending: held,
            retry_backlog: invisible - held + delayed,
            dead_letters,
            oldest_dead_letter_age: None,
            queue_depth: Some(visible + invisible + delayed),
            oldest_waiting_age: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant, SystemTime};

    use aws_sdk_sqs::Client;
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
    use bytes::Bytes;

    use super::*;
    use crate::SqsSource;
    use crate::connection::queue_url;
    use courier_core::model::Failure;
    use courier_core::source::{
        Consumer, DeadLetterStore, ErrorKind, Observed, SettleBy, SourceOptions,
    };

    const REGION: &str = "us-east-1";

    /// moto (`scripts/moto-server`, the SQS stand-in of the tests) on a
    /// free port, ended when this is dropped.
    struct Moto {
        child: Child,
        endpoint: String,
    }

    impl Moto {
        fn start() -> Self {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .unwrap()
                .port();
            let script =
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/moto-server");
            let child = Command::new(script)
                .args(["-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("scripts/moto-server");
            let moto = Self {
                child,
                endpoint: format!("http://127.0.0.1:{port}"),
            };
            // The first run installs moto in .venv-moto.
            let deadline = Instant::now() + Duration::from_secs(300);
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "moto did not start on {port}");
                std::thread::sleep(Duration::from_millis(100));
            }
            moto
        }

        fn client(&self) -> Client {
            let http = aws_smithy_http_client::Builder::new()
                .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
                .build_https();
            let config = aws_sdk_sqs::Config::builder()
                .behavior_version(BehaviorVersion::latest())
                .region(Region::new(REGION))
                .endpoint_url(&self.endpoint)
                .credentials_provider(Credentials::new("testing", "testing", None, None, "test"))
                .http_client(http)
                .build();
            Client::from_conf(config)
        }
    }

    impl Drop for Moto {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Against moto: an admin handle reads the figures the sidecar's gauges
    /// read, with messages visible, one with the app, one invisible for a
    /// retry and one dead-lettered. Its process holds nothing, so what the
    /// sidecar's app holds is retry backlog to it (`docs/sources.md`: pending
    /// is what this process holds); once nothing is held the two readings
    /// are one. A missing work queue is named, and the handle creates no
    /// queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_handle_reads_the_depth_the_sidecar_reads() {
        let moto = Moto::start();
        let client = moto.client();
        let queue = format!("unit-depth-{}", rand::random::<u32>());
        let mut options = SourceOptions::new(&queue);
        let dlq = options.live.dead_letter_queue.clone();
        let dlq_name = dead_letter_queue_name(&dlq);
        let admin = SqsStore::admin(client.clone(), REGION, options.clone());

        let err = admin.depth_of(&dlq).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        assert!(err.message().contains(&queue), "{err}");
        for name in [&queue, &dlq_name] {
            let found = queue_url(&client, name, false).await.unwrap();
            assert_eq!(found, None, "{name} was made");
        }

        options.create = true;
        let source = SqsSource::connect_with(client.clone(), REGION, options)
            .await
            .unwrap();
        for i in 0..6 {
            admin.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
        }
        let fresh = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(fresh, source.depth().await.unwrap());
        assert_eq!(
            (fresh.ready, fresh.pending, fresh.dead_letters),
            (Some(6), 0, 0),
            "{fresh:?}"
        );

        let mut got = Vec::new();
        while got.len() < 4 {
            got.extend(source.receive(4 - got.len()).await.unwrap());
        }
        let now = SystemTime::now();
        source
            .dead_letter(
                &got[0],
                &Failure::permanent_422(&queue, &dlq, &got[0].message.id),
            )
            .await
            .unwrap();
        source
            .retry(&got[1], 2, now, now + Duration::from_secs(3600))
            .await
            .unwrap();
        source.ack(&got[2]).await.unwrap();

        let sidecar = source.depth().await.unwrap();
        let read = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(
            (sidecar.pending, sidecar.retry_backlog),
            (1, 1),
            "{sidecar:?}"
        );
        assert_eq!(
            Depth {
                pending: 1,
                retry_backlog: read.retry_backlog - 1,
                ..read.clone()
            },
            sidecar,
            "the admin handle's reading, with the one delivery the sidecar holds"
        );
        assert_eq!(
            (read.ready, read.dead_letters, read.queue_depth),
            (Some(2), 1, Some(4)),
            "{read:?}"
        );

        source.ack(&got[3]).await.unwrap();
        let sidecar = source.depth().await.unwrap();
        let read = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(read, sidecar);
        assert_eq!(
            (
                read.ready,
                read.pending,
                read.retry_backlog,
                read.dead_letters,
                read.queue_depth
            ),
            (Some(2), 0, 1, 1, Some(3)),
            "{read:?}"
        );
        source.close().await;
    }
}
