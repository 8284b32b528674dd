"""The courier alerts: the one source that monitoring/generate.py turns into
Prometheus rules, a PrometheusRule and Grafana alert rules.

Each alert is a query, a comparison and a threshold kept apart, because
Grafana evaluates them as separate steps (query, reduce, threshold) while
Prometheus wants them joined into one expression.

Fields:
  name         the alert name, also the runbook heading
  severity     "warning" or "critical"
  query        PromQL whose result is one series per thing to alert on
  op           ">" or "<" (Grafana's threshold step has no portable equality)
  threshold    the number the query result is compared with
  for          how long the condition must hold before the alert fires ("" for at once)
  summary      one line; Prometheus template syntax
  description  what is wrong and what it costs; Prometheus template syntax,
               {{ $value }} is the query result
  runbook      the anchor of the alert's section in docs/runbook.md

Aggregation: depth, age and backlog gauges describe a queue, and every replica
reports the same number, so they are taken with `max by (namespace, queue)`;
counters count per pod, so their rates are summed by (namespace, queue). Either
way five replicas raise one alert per queue.

Double scrape: a pod scraped twice (a PodMonitor by port name and a
`prometheus.io/scrape` job) has each series twice, differing only in job and
instance. Per-pod values are therefore first taken with `max by (..., pod)`,
which folds the copies into one, and only then summed, so a rate is never
counted twice.
"""

# Where runbook_url points. Relative to the repository root; set it to the
# published location of the runbook for clickable links, then regenerate.
RUNBOOK_URL = "docs/runbook.md"

# The rule group name in Prometheus and in Grafana, and the Grafana folder.
GROUP = "courier"

# Grafana expands ${...} in provisioning files from its environment, so the
# operator sets this variable to the UID of their Prometheus data source.
GRAFANA_DATASOURCE_UID = "${PROMETHEUS_DATASOURCE_UID}"

# Strips a pod name to its workload: a Deployment's pod NAME-HASH-XXXXX and a
# StatefulSet's NAME-N both become NAME; any other name stays as it is.
def with_workload(series):
    return (
        'label_replace(label_replace(label_replace('
        f'{series}, "workload", "$1", "pod", "(.*)"), '
        '"workload", "$1", "pod", "(.+)-[0-9]+"), '
        '"workload", "$1", "pod", "(.+)-[a-z0-9]{6,10}-[a-z0-9]{5}")'
    )


ALERTS = [
    {
        "name": "CourierDeadLettersPresent",
        "severity": "warning",
        "query": "max by (namespace, queue) (courier_dlq_depth)",
        "op": ">",
        "threshold": 0,
        "for": "10m",
        "summary": "Dead letters are waiting on queue {{ $labels.queue }}",
        "description": (
            "The dead-letter queue of {{ $labels.queue }} (namespace {{ $labels.namespace }}) "
            "has held messages for at least 10 minutes and holds {{ $value }} now. Each is a "
            "message the app did not accept: inspect them, fix the cause, then replay or "
            "purge them."
        ),
        "runbook": "courierdeadletterspresent",
    },
    {
        "name": "CourierDeadLettersArrivingFast",
        "severity": "critical",
        # One dead letter a second for five minutes is 300 messages the app
        # refused: far past the odd poison message, something is broken.
        "query": (
            "sum by (namespace, queue) "
            "(max by (namespace, queue, pod, reason) (rate(courier_dead_letters_total[5m])))"
        ),
        "op": ">",
        "threshold": 1,
        "for": "5m",
        "summary": "Messages on queue {{ $labels.queue }} are being dead-lettered fast",
        "description": (
            "{{ $labels.queue }} (namespace {{ $labels.namespace }}) is dead-lettering "
            '{{ printf "%.2f" $value }} messages per second, all pods and reasons together, '
            "and has for 5 minutes. The app is refusing or failing most of what it gets."
        ),
        "runbook": "courierdeadlettersarrivingfast",
    },
    {
        "name": "CourierDeadLetterOldest",
        "severity": "warning",
        "query": "max by (namespace, queue) (courier_dlq_oldest_age_seconds)",
        "op": ">",
        "threshold": 86400,
        "for": "5m",
        "summary": "A dead letter on queue {{ $labels.queue }} is older than a day",
        "description": (
            "The oldest dead letter of {{ $labels.queue }} (namespace {{ $labels.namespace }}) "
            "is {{ $value | humanizeDuration }} old. Nobody has replayed or purged it; "
            "the message it carries may no longer be useful to anyone."
        ),
        "runbook": "courierdeadletteroldest",
    },
    {
        "name": "CourierAppDown",
        "severity": "critical",
        # courier_app_up belongs to one pod's app container; the alert counts
        # the pods of one workload whose app is down, so a Deployment of ten
        # pages once, not ten times.
        "query": (
            "sum by (namespace, workload) (1 - max by (namespace, workload, pod) "
            f"({with_workload('courier_app_up')}))"
        ),
        "op": ">",
        "threshold": 0,
        "for": "5m",
        "summary": "The app of {{ $labels.workload }} is down in {{ $value }} pod(s)",
        "description": (
            "courier has not reached the app of {{ $labels.namespace }}/{{ $labels.workload }} "
            "for 5 minutes in {{ $value }} pod(s). Those pods have stopped pulling messages; "
            "they wait in the broker for the other replicas."
        ),
        "runbook": "courierappdown",
    },
    {
        "name": "CourierBrokerDown",
        "severity": "critical",
        # courier_broker_up is one pod's: 0 while its source cannot be
        # opened (broker unreachable, credentials refused) or its
        # connection is lost. Counted per workload, like CourierAppDown.
        "query": (
            "sum by (namespace, workload) (1 - max by (namespace, workload, pod) "
            f"({with_workload('courier_broker_up')}))"
        ),
        "op": ">",
        "threshold": 0,
        "for": "5m",
        "summary": "courier of {{ $labels.workload }} cannot reach its broker in {{ $value }} pod(s)",
        "description": (
            "courier in {{ $value }} pod(s) of {{ $labels.namespace }}/{{ $labels.workload }} has "
            "not been connected to its broker for 5 minutes: the source cannot be opened or its "
            "connection is lost. Those pods consume nothing; /readyz says why."
        ),
        "runbook": "courierbrokerdown",
    },
    {
        "name": "CourierRetryBacklogGrowing",
        "severity": "warning",
        # The slope of the queue's backlog, taken after max() so that a
        # replica's restart does not look like growth; in messages a minute.
        "query": "deriv(max by (namespace, queue) (courier_retry_backlog)[15m:1m]) * 60",
        "op": ">",
        # Messages a minute: a backlog that creeps up by a few messages an
        # hour is noise, not an incident.
        "threshold": 1,
        "for": "15m",
        "summary": "The retry backlog of queue {{ $labels.queue }} keeps growing",
        "description": (
            "The retry backlog of {{ $labels.queue }} (namespace {{ $labels.namespace }}) has "
            'grown for 15 minutes, by about {{ printf "%.1f" $value }} messages a minute: '
            "retries are scheduled faster than they succeed, usually because the app keeps "
            "failing transiently."
        ),
        "runbook": "courierretrybackloggrowing",
    },
    {
        "name": "CourierPolicyRejected",
        "severity": "warning",
        # The reload counter has no queue or policy label; the namespace is the
        # finest grouping that every replica of one deployment shares.
        "query": (
            "sum by (namespace) (max by (namespace, pod) "
            '(increase(courier_policy_reloads_total{result="rejected"}[15m])))'
        ),
        "op": ">",
        "threshold": 0,
        "for": "",
        "summary": "courier refused a RetryPolicy change in namespace {{ $labels.namespace }}",
        "description": (
            "courier pods in namespace {{ $labels.namespace }} refused a RetryPolicy change "
            '(rejected reloads in the last 15 minutes, all pods together: {{ printf "%.0f" $value }}). '
            "The last good policy stays in force until the change is fixed."
        ),
        "runbook": "courierpolicyrejected",
    },
    {
        "name": "CourierPolicyNotReady",
        "severity": "critical",
        # A pod that cannot read its RetryPolicy (forbidden, or the CRD not
        # installed) pulls nothing and shows every other metric at 0. Pods
        # are counted once each, however often they are scraped.
        "query": "count by (namespace) (max by (namespace, pod) (courier_policy_ready) == 0)",
        "op": ">",
        "threshold": 0,
        "for": "5m",
        "summary": "courier cannot read its RetryPolicy in namespace {{ $labels.namespace }}",
        "description": (
            "{{ $value }} courier pods in namespace {{ $labels.namespace }} have not been able "
            "to read their RetryPolicy for 5 minutes (forbidden, or the CRD not installed): they "
            "pull nothing. Their /readyz says what to grant or install."
        ),
        "runbook": "courierpolicynotready",
    },
    {
        "name": "CourierRetryRateHigh",
        "severity": "warning",
        # Retries per delivery attempt: above a quarter for 15 minutes, the
        # app fails transiently far more than a healthy one does.
        "query": (
            "sum by (namespace, queue) "
            "(max by (namespace, queue, pod) (rate(courier_retries_total[10m]))) "
            "/ sum by (namespace, queue) "
            "(max by (namespace, queue, pod, result) (rate(courier_deliveries_total[10m])))"
        ),
        "op": ">",
        "threshold": 0.25,
        "for": "15m",
        "summary": "Many deliveries on queue {{ $labels.queue }} are retried",
        "description": (
            '{{ $value | humanizePercentage }} of the deliveries of {{ $labels.queue }} '
            "(namespace {{ $labels.namespace }}) have been scheduled for a retry over the "
            "last 15 minutes: the app is failing transiently (5xx, 429, timeouts)."
        ),
        "runbook": "courierretryratehigh",
    },
    {
        "name": "CourierNotConsuming",
        "severity": "critical",
        # Work waits in the broker's queue and nothing was acked for 10
        # minutes: no consumer makes progress, whether the sidecars are stuck
        # on an app that does not answer or pull nothing at all. The depth
        # is the broker's count, the same in every replica: max, not sum.
        "query": (
            "(max by (namespace, queue) (courier_queue_depth) "
            "unless on (namespace, queue) "
            "(sum by (namespace, queue) "
            "(max by (namespace, queue, pod) (increase(courier_acks_total[10m]))) > 0) "
            # A queue paused on purpose (spec.paused) acks nothing either;
            # CourierQueuePaused speaks for it.
            "unless on (namespace, queue) (max by (namespace, queue) (courier_paused) > 0))"
        ),
        "op": ">",
        "threshold": 0,
        "for": "10m",
        "summary": "Nothing on queue {{ $labels.queue }} has been acked for 10 minutes while work waits",
        "description": (
            "{{ $value }} messages wait in the work queue {{ $labels.queue }} (namespace "
            "{{ $labels.namespace }}) and courier has acked none for at least 10 minutes: "
            "the app is not answering, answers only with failures, or no sidecar is pulling."
        ),
        "runbook": "couriernotconsuming",
    },
    {
        "name": "CourierQueuePaused",
        "severity": "warning",
        # courier_paused is 1 while the queue's RetryPolicy pauses it, in
        # every replica alike: max, as for the other queue gauges. A pause
        # is deliberate, so it only warns, and only once it has outlasted
        # the hold below; the chart's monitoring.prometheusRule.for changes
        # that hold, which is why the texts do not name it.
        "query": "max by (namespace, queue) (courier_paused)",
        "op": ">",
        "threshold": 0,
        "for": "1h",
        "summary": "Queue {{ $labels.queue }} is still paused by its RetryPolicy",
        "description": (
            "The RetryPolicy of {{ $labels.queue }} (namespace {{ $labels.namespace }}) has "
            "paused its consumption for longer than this alert allows: no replica pulls from it "
            "and its messages wait in the broker. If the incident it was paused for is over, "
            "resume it: kubectl -n {{ $labels.namespace }} patch retrypolicy NAME --type merge "
            """-p '{"spec":{"paused":false}}' (NAME is the pods' courier.dev/policy)."""
        ),
        "runbook": "courierqueuepaused",
    },
]
