//! The KEDA examples in `examples/keda/` scale on what courier consumes: each
//! Deployment goes through the injector's own code (as the webhook would
//! treat its pods), and the ScaledObject's trigger must name the broker,
//! stream, queue and group the injected sidecar is given. An example whose
//! names drift from its annotations scales on a queue nobody reads.

use std::path::{Path, PathBuf};

use courier::inject::{Decision, SidecarDefaults, inject_document};
use serde_json::Value;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/keda")
}

/// The documents of one example file.
struct Example {
    file: String,
    docs: Vec<Value>,
}

impl Example {
    fn read(name: &str) -> Self {
        let path = examples().join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
        Self {
            file: name.into(),
            docs,
        }
    }

    fn kind(&self, kind: &str) -> &Value {
        let found: Vec<&Value> = self.docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "{}: one {kind}", self.file);
        found[0]
    }

    /// The sidecar's `COURIER_*` variables, as the injector sets them for the
    /// Deployment's pods.
    fn sidecar_env(&self) -> Vec<Value> {
        let deployment = self.kind("Deployment").clone();
        let (injected, decision) =
            inject_document(deployment, &SidecarDefaults::chart()).expect("a pod template");
        assert!(
            matches!(decision, Decision::Inject { .. }),
            "{}: the injector does not inject: {decision}",
            self.file
        );
        let spec = &injected["spec"]["template"]["spec"];
        let sidecar = spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
            .find(|c| c["name"] == "courier")
            .unwrap_or_else(|| panic!("{}: no courier container after injection", self.file));
        sidecar["env"].as_array().cloned().unwrap_or_default()
    }

    /// The value of the sidecar's variable `name`: a plain value, or the
    /// (Secret, key) it is read from.
    fn var(&self, name: &str) -> Option<Value> {
        self.sidecar_env()
            .into_iter()
            .find(|v| v["name"] == name)
            .map(|v| match v.get("value") {
                Some(value) => value.clone(),
                None => v["valueFrom"]["secretKeyRef"].clone(),
            })
    }

    fn text(&self, name: &str) -> String {
        self.var(name)
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| panic!("{}: the sidecar has no {name}", self.file))
    }

    /// The group courier joins: `courier.dev/group`, else courier's default.
    fn group(&self) -> String {
        self.var("COURIER_GROUP")
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| "courier".into())
    }

    /// The one trigger of the ScaledObject, which must scale this example's
    /// Deployment, and its metadata.
    fn trigger(&self, kind: &str) -> (&Value, &Value) {
        let deployment = self.kind("Deployment");
        let scaled = self.kind("ScaledObject");
        assert_eq!(
            scaled["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"],
            "{}: the ScaledObject scales another Deployment",
            self.file
        );
        assert_eq!(
            scaled["metadata"]["namespace"], deployment["metadata"]["namespace"],
            "{}: the ScaledObject is in another namespace",
            self.file
        );
        let triggers = scaled["spec"]["triggers"].as_array().expect("triggers");
        assert_eq!(triggers.len(), 1, "{}: one trigger", self.file);
        let trigger = &triggers[0];
        assert_eq!(trigger["type"], kind, "{}: the trigger's type", self.file);
        (trigger, &trigger["metadata"])
    }
}

/// `host:port` and the path of a broker URL (`scheme://[user@]host:port/path`).
fn host_port_path(url: &str) -> (String, String) {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    (host.to_string(), path.to_string())
}

#[test]
fn every_example_is_checked_here() {
    let mut files: Vec<String> = std::fs::read_dir(examples())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["nats-jetstream.yaml", "rabbitmq.yaml", "redis-streams.yaml"],
        "a new example needs a test here"
    );
}

#[test]
fn the_redis_example_scales_on_the_stream_and_group_courier_reads() {
    let example = Example::read("redis-streams.yaml");
    let (_, meta) = example.trigger("redis-streams");
    assert_eq!(meta["stream"], example.text("COURIER_QUEUE").as_str());
    assert_eq!(meta["consumerGroup"], example.group().as_str());
    let (address, db) = host_port_path(&example.text("COURIER_SOURCE"));
    assert_eq!(meta["address"], address.as_str(), "the Redis server");
    let db = if db.is_empty() { "0".into() } else { db };
    assert_eq!(meta["databaseIndex"], db.as_str(), "the database");
}

#[test]
fn the_rabbitmq_example_scales_on_the_queue_courier_reads() {
    let example = Example::read("rabbitmq.yaml");
    let (trigger, meta) = example.trigger("rabbitmq");
    assert_eq!(meta["queueName"], example.text("COURIER_QUEUE").as_str());
    // The broker URL comes from the Secret courier reads it from.
    let source = example
        .var("COURIER_SOURCE")
        .expect("the sidecar has COURIER_SOURCE");
    let auth = example.kind("TriggerAuthentication");
    assert_eq!(
        trigger["authenticationRef"]["name"], auth["metadata"]["name"],
        "the trigger's TriggerAuthentication"
    );
    let host = auth["spec"]["secretTargetRef"]
        .as_array()
        .expect("secretTargetRef")
        .iter()
        .find(|r| r["parameter"] == "host")
        .expect("the host parameter");
    assert_eq!(
        (&host["name"], &host["key"]),
        (&source["name"], &source["key"]),
        "KEDA reads the broker URL from the Secret and key courier reads"
    );
}

#[test]
fn the_nats_example_scales_on_the_stream_and_consumer_courier_reads() {
    let example = Example::read("nats-jetstream.yaml");
    let (_, meta) = example.trigger("nats-jetstream");
    assert_eq!(meta["stream"], example.text("COURIER_QUEUE").as_str());
    assert_eq!(meta["consumer"], example.group().as_str());
    // The monitoring endpoint is the servers' headless Service: each server
    // courier lists is a pod under it (KEDA asks each of them in a cluster).
    let endpoint = meta["natsServerMonitoringEndpoint"]
        .as_str()
        .expect("natsServerMonitoringEndpoint");
    let service = endpoint.split(':').next().unwrap();
    let source = example.text("COURIER_SOURCE");
    for server in source.trim_start_matches("nats://").split(',') {
        let (host, _) = host_port_path(server);
        let host = host.split(':').next().unwrap();
        assert!(
            host == service || host.ends_with(&format!(".{service}")),
            "courier's server {host} is not behind the monitored service {service}"
        );
    }
}
