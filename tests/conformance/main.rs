//! The conformance suite: every scenario runs on every broker whose
//! capabilities allow it, against a real broker and a real HTTP app on
//! loopback, with messages published by the broker's own client.
//!
//! A test is `<broker>::<scenario>`, so `cargo test --test conformance --
//! redis::` runs one broker. `redis_cluster` is Redis again, as the 3+3
//! Redis Cluster `scripts/services` starts, reached through a node that
//! does not own the queue's hash slot. A new broker is one fixture in
//! `tests/common/brokers.rs` and one line in the `suite!` list below; a new
//! scenario is one line in the scenario list, with what it needs of the
//! source. A scenario a broker cannot support is skipped by its
//! [`Capabilities`], never by the broker's name; each fixture pins the
//! capabilities its source claims (`BrokerFixture::CAPABILITIES`), checked
//! by `<broker>::capabilities_are_pinned`, and a skip those do not expect
//! fails.
//!
//! - `delivery`: the classification table, Retry-After, headers, attempts,
//!   bodies, an unreachable app, a policy file reload, dead letters read
//!   with the broker's own client (in-process sidecar); the enqueue time a
//!   delivery carries, across a retry and a give-back (the source alone);
//! - `process`: the built binary: `kill -9` mid-flight, a scheduled retry
//!   across a restart, SIGTERM drains, `--drain-timeout`, attempts across
//!   stops and crashes;
//! - `dedup`: `--dedup-window`;
//! - `bad_inputs`: hostile producer headers and app answers;
//! - `dlq`: `courier dlq list/show/replay/purge`;
//! - `dlq_filter`: `courier dlq --filter` expressions;
//! - `lineage`: a replay's `Courier-Replay-Count`, and the dead letter it
//!   makes naming the letter it came from, with the history;
//! - `snapshot`: a bulk command's set is fixed before it acts;
//! - `replay_rate`: `dlq replay --rate` keeps its rate;
//! - `replay_to`: `dlq replay --to` another queue;
//! - `jobs`: `courier dlq jobs`: a replay's or purge's record on the
//!   broker, resumed after a kill, cancelled;
//! - `edit`: `courier dlq edit`, a dead letter fixed with a JSON Patch and
//!   replayed;
//! - `depth`: the work queue's depth and oldest age on `/metrics`;
//! - `seal`: a producer's `courier-*` fields are not courier's state;
//! - `flow`: the policy's `rateLimit` (pacing, a live edit, `scope: queue`
//!   across replicas), `paused` across a restart, and `maxAge`;
//! - `batch`: several messages in one POST, a status per entry, a
//!   poison message split out;
//! - `only`: what holds for one broker alone.

#[path = "../common/mod.rs"]
mod common;

mod bad_inputs;
mod batch;
mod dedup;
mod delivery;
mod depth;
mod dlq;
mod dlq_filter;
mod edit;
mod flow;
mod jobs;
mod lineage;
mod only;
mod process;
mod replay_rate;
mod replay_to;
mod routing;
mod seal;
mod snapshot;
mod subscriptions;

use std::future::Future;

use common::*;
use courier::source::Capabilities;

/// What a scenario needs of a source beyond receiving and settling.
#[derive(Debug, Clone, Copy)]
enum Needs {
    /// Every source can run it.
    Nothing,
    /// Dead letters listed, replayed and purged one by one.
    DeadLetterBrowsing,
    /// A deduplication window.
    Dedup,
    /// No deduplication window (its fallback).
    NoDedup,
    /// A rate-limit bucket on the broker that every replica shares.
    SharedRateLimit,
    /// `courier dlq` job records kept on the broker.
    DeadLetterJobs,
    /// Job records, and a second process beside a running job.
    JobsFromAnotherProcess,
    /// Dead-letter browsing, and a sidecar beside a running `courier dlq`
    /// (the embedded queue is one process's at a time).
    BrowsingFromAnotherProcess,
}

impl Needs {
    fn met_by(self, capabilities: &Capabilities) -> bool {
        match self {
            Self::Nothing => true,
            Self::DeadLetterBrowsing => capabilities.dead_letter_browsing,
            Self::Dedup => capabilities.dedup,
            Self::NoDedup => !capabilities.dedup,
            Self::SharedRateLimit => capabilities.shared_rate_limit,
            Self::DeadLetterJobs => capabilities.dead_letter_jobs,
            Self::BrowsingFromAnotherProcess => {
                capabilities.dead_letter_browsing && capabilities.multi_process
            }
            Self::JobsFromAnotherProcess => {
                capabilities.dead_letter_jobs && capabilities.multi_process
            }
        }
    }
}

/// Runs `scenario` on a fresh queue of `broker`, or says why it cannot: a
/// skip the broker's pinned capabilities do not expect fails.
async fn run<F, Fut>(broker: BrokerKind, needs: Needs, scenario: F)
where
    F: FnOnce(Fixture) -> Fut,
    Fut: Future<Output = ()>,
{
    let fixture = broker.fixture();
    let source = fixture.open().await;
    let capabilities = source.capabilities();
    release(&fixture, source).await;
    if !needs.met_by(&capabilities) {
        let pinned = broker.capabilities();
        assert!(
            !needs.met_by(&pinned),
            "the {} source does not offer {needs:?} ({capabilities:?}), though its fixture pins it \
             ({pinned:?}): the scenario would be skipped",
            broker.name()
        );
        eprintln!(
            "skipped: the {} source does not offer {needs:?} ({capabilities:?}), as pinned",
            broker.name()
        );
        return;
    }
    scenario(fixture).await;
}

/// The capabilities `broker`'s source claims are the ones its fixture pins
/// in `tests/common/brokers.rs`, flag by flag.
async fn capabilities_are_pinned(broker: BrokerKind) {
    let fixture = broker.fixture();
    let source = fixture.open().await;
    let claimed = source.capabilities();
    release(&fixture, source).await;
    assert_eq!(
        claimed,
        broker.capabilities(),
        "the {} source claims other capabilities than its fixture pins (left: claimed, right: \
         pinned); change the pin in tests/common/brokers.rs together with the source, knowing \
         which conformance scenarios start or stop running on it",
        broker.name()
    );
}

/// One module per broker, one `#[tokio::test]` per scenario in it.
macro_rules! suite {
    ([$($broker:ident => $kind:ident),+ $(,)?], $scenarios:tt) => {
        /// The brokers the suite runs on.
        const SUITE: &[BrokerKind] = &[$(BrokerKind::$kind),+];
        $( suite!(@broker $broker, $kind, $scenarios); )+
    };
    (@broker $broker:ident, $kind:ident,
        [$($module:ident :: $scenario:ident if $needs:ident),+ $(,)?]) => {
        mod $broker {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn capabilities_are_pinned() {
                super::capabilities_are_pinned(BrokerKind::$kind).await;
            }

            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    run(BrokerKind::$kind, Needs::$needs, $module::$scenario).await;
                }
            )+
        }
    };
}

suite!(
    [
        redis => Redis,
        redis_cluster => RedisCluster,
        amqp => Amqp,
        nats => Nats,
        embedded => Embedded,
        kafka => Kafka,
        sqs => Sqs,
        pubsub => PubSub,
    ],
    [
        delivery::classification_table if DeadLetterBrowsing,
        delivery::retry_after_is_honored if Nothing,
        delivery::headers_and_idempotency if Nothing,
        delivery::attempts_exhausted if DeadLetterBrowsing,
        delivery::permanent_status if DeadLetterBrowsing,
        delivery::acked_exactly_once if Nothing,
        delivery::bodies_are_bytes if DeadLetterBrowsing,
        delivery::unreachable_app_uses_no_attempts if DeadLetterBrowsing,
        delivery::policy_file_reload if DeadLetterBrowsing,
        delivery::a_live_lower_max_attempts_exhausts_attempts if DeadLetterBrowsing,
        delivery::dead_letters_are_readable_with_the_brokers_own_client if Nothing,
        delivery::enqueued_at_survives_retries if Nothing,
        process::crash_mid_flight_loses_nothing if DeadLetterBrowsing,
        process::scheduled_retry_survives_restart if DeadLetterBrowsing,
        process::sigterm_drains_in_flight if DeadLetterBrowsing,
        process::drain_timeout_cuts_off_and_redelivers if DeadLetterBrowsing,
        process::a_graceful_stop_uses_no_attempts if Nothing,
        process::a_crash_mid_delivery_counts_an_attempt if Nothing,
        dedup::a_duplicate_within_the_window_does_not_reach_the_app if Dedup,
        dedup::without_a_window_duplicates_are_delivered if Nothing,
        dedup::the_window_expires if Dedup,
        dedup::without_support_the_window_is_off_with_a_warning if NoDedup,
        bad_inputs::an_idempotency_key_http_cannot_carry_is_undeliverable if DeadLetterBrowsing,
        bad_inputs::an_unreadable_retry_after_is_ignored_and_counted if Nothing,
        bad_inputs::more_headers_than_the_cap_is_undeliverable if DeadLetterBrowsing,
        bad_inputs::a_header_named_payload_is_a_header if Nothing,
        bad_inputs::a_huge_answer_is_cut_to_the_excerpt if DeadLetterBrowsing,
        bad_inputs::header_values_with_line_breaks_and_non_ascii_survive if DeadLetterBrowsing,
        dlq::list_show_replay_purge if DeadLetterBrowsing,
        dlq::replay_killed_halfway_loses_nothing if DeadLetterBrowsing,
        dlq::read_only_commands_leave_the_broker_as_found if Nothing,
        dlq::a_key_rotation_keeps_copies_sealed_within_the_window if DeadLetterBrowsing,
        dlq_filter::dlq_filter_selects_by_reason_status_header_and_body if DeadLetterBrowsing,
        lineage::a_replay_carries_its_lineage if DeadLetterBrowsing,
        snapshot::a_replay_leaves_letters_arriving_after_its_snapshot if BrowsingFromAnotherProcess,
        replay_rate::a_replay_keeps_its_rate if DeadLetterBrowsing,
        replay_to::a_replay_goes_to_the_queue_named if DeadLetterBrowsing,
        edit::edit_replays_the_patched_message if DeadLetterBrowsing,
        jobs::job_records_are_kept if DeadLetterJobs,
        jobs::a_killed_replay_job_resumes if DeadLetterJobs,
        jobs::a_replay_job_is_cancelled if JobsFromAnotherProcess,
        depth::waiting_messages_show_as_depth_and_age if Nothing,
        seal::forged_courier_fields_are_not_state if DeadLetterBrowsing,
        flow::rate_limit_paces_deliveries_and_follows_a_live_edit if Nothing,
        flow::pause_stops_deliveries_and_survives_a_restart if Nothing,
        flow::max_age_dead_letters_old_messages_as_expired if Nothing,
        flow::queue_scope_holds_the_total_across_replicas if SharedRateLimit,
        routing::routes_send_messages_by_content_and_follow_live_edits if Nothing,
        subscriptions::a_struggling_subscription_does_not_slow_the_others if Nothing,
        batch::one_poison_message_costs_its_neighbours_nothing if Nothing,
        batch::each_entry_is_settled_as_its_status_says if Nothing,
        batch::a_partial_batch_goes_after_its_wait if Nothing,
        batch::events_go_in_cloudevents_batched_mode if Nothing,
    ]
);

/// Every broker this build of courier knows has a fixture here, so no
/// broker can be added without running the suite on it.
#[test]
fn every_broker_has_a_fixture() {
    for broker in courier::source::BROKERS {
        let kind = BrokerKind::of(broker.name).unwrap_or_else(|| {
            panic!(
                "courier knows the broker {:?} but the tests have no fixture for it: add one to tests/common/brokers.rs and a line to the suite! list in tests/conformance/main.rs",
                broker.name
            )
        });
        assert_eq!(kind.name(), broker.name);
        assert!(
            SUITE.contains(&kind),
            "the suite! list in tests/conformance/main.rs does not run on {:?}",
            broker.name
        );
    }
    for kind in BrokerKind::ALL {
        let first = BrokerKind::of(kind.name()).map(BrokerKind::name);
        assert_eq!(first, Some(kind.name()), "{kind:?}");
        assert!(SUITE.contains(&kind), "the suite does not run on {kind:?}");
    }
}
