//! The Helm chart carries copies of files that live elsewhere in the
//! repository (Helm cannot read outside the chart directory). Each copy must
//! be byte-identical to its original; when one fails, copy the original over.

use std::path::Path;

fn assert_same(copy: &str, original: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read =
        |p: &str| std::fs::read(root.join(p)).unwrap_or_else(|e| panic!("cannot read {p}: {e}"));
    assert!(
        read(copy) == read(original),
        "{copy} differs from {original}; run: cp {original} {copy}"
    );
}

#[test]
fn chart_crd_is_the_generated_crd() {
    assert_same(
        "charts/courier/crds/retrypolicy.yaml",
        "crds/retrypolicy.yaml",
    );
}

#[test]
fn chart_prometheus_rule_is_the_monitoring_one() {
    assert_same(
        "charts/courier/files/courier-prometheusrule.yaml",
        "monitoring/prometheus/courier-prometheusrule.yaml",
    );
}

#[test]
fn chart_dashboard_is_the_monitoring_one() {
    assert_same(
        "charts/courier/files/courier-dashboard.json",
        "monitoring/grafana/courier-dashboard.json",
    );
}
