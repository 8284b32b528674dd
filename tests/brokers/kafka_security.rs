//! Kafka as managed clusters run it: `kafkas://` with `--tls-ca-file` (and
//! a client certificate for mutual TLS), SASL PLAIN and SCRAM-SHA-256/512
//! with the password from a file or `COURIER_KAFKA_SASL_PASSWORD`, and
//! OAUTHBEARER with a token from an OAuth token endpoint, through the
//! built binary: `courier run`, `courier send` (its flags as `COURIER_*`
//! variables) and `courier dlq list`. Then the refusals, each ending the
//! start with exit 1 and naming the setting to fix, the usage errors with
//! exit 2, and no secret in the log at trace level.
//!
//! There is no Kafka broker here: each cluster is librdkafka's mock behind
//! kafka-mock's front, which speaks TLS and the Kafka protocol's SASL
//! exchange (SaslHandshake, SaslAuthenticate) the way a broker does and
//! then lets the requests through to the mock.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::tls::{
    ca_only, certs, delivers_over_tls, dlq_list,
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate, run_ends, send, text,
};
use crate::common::*;

const PLAIN: (&str, &str) = ("alice", "plain-pw-7f3a9c");
const SCRAM_256: (&str, &str) = ("bob", "scram256-pw-52e1d0");
const SCRAM_512: (&str, &str) = ("carol", "scram512-pw-c8b4a6");
const OAUTH_CLIENT: (&str, &str) = ("courier-client", "oauth-secret-1d9e77");

/// A one-broker cluster behind a front started with `flags`, kept for
/// this test binary.
fn front(slot: &'static OnceLock<KafkaMock>, flags: fn() -> Vec<String>) -> &'static KafkaMock {
    slot.get_or_init(|| KafkaMock::start_with(1, &flags()))
}

fn tls_flags() -> Vec<String> {
    let c = certs();
    vec![
        "--tls-cert".into(),
        c.path("server.crt").display().to_string(),
        "--tls-key".into(),
        c.path("server.key").display().to_string(),
    ]
}

fn sasl_flags() -> Vec<String> {
    [
        ("PLAIN", PLAIN),
        ("SCRAM-SHA-256", SCRAM_256),
        ("SCRAM-SHA-512", SCRAM_512),
    ]
    .into_iter()
    .flat_map(|(mechanism, (user, password))| {
        [
            "--sasl".to_string(),
            format!("{mechanism}:{user}:{password}"),
        ]
    })
    .collect()
}

fn tls_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, tls_flags)
}

fn mutual_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, || {
        let mut flags = tls_flags();
        flags.extend(["--tls-client-ca".into(), certs().ca()]);
        flags
    })
}

fn sasl_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, sasl_flags)
}

fn sasl_tls_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, || [tls_flags(), sasl_flags()].concat())
}

fn oauth_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, || {
        [
            tls_flags(),
            vec!["--sasl".into(), format!("OAUTHBEARER:{}", oauth_token())],
        ]
        .concat()
    })
}

/// A front that takes another bearer token than the identity provider
/// below issues.
fn other_oauth_front() -> &'static KafkaMock {
    static SLOT: OnceLock<KafkaMock> = OnceLock::new();
    front(&SLOT, || {
        [
            tls_flags(),
            vec![
                "--sasl".into(),
                "OAUTHBEARER:a-token-of-another-issuer".into(),
            ],
        ]
        .concat()
    })
}

/// `kafkas://` to a front's bootstrap servers.
fn tls_url(mock: &KafkaMock) -> String {
    format!("kafkas://{}", mock.bootstrap)
}

/// A file holding `secret`, with the newline an editor or `kubectl create
/// secret --from-file` leaves.
fn secret_file(secret: &str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("courier-kafka-sasl-")
            .tempdir()
            .unwrap()
            .keep()
    });
    let path = dir.join(unique("secret"));
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path
}

/// The flags of a SASL login with the password in a file.
fn login(mechanism: &str, (user, password): (&str, &str)) -> Vec<String> {
    vec![
        "--kafka-sasl-mechanism".into(),
        mechanism.into(),
        "--kafka-sasl-username".into(),
        user.into(),
        "--kafka-sasl-password-file".into(),
        secret_file(password).display().to_string(),
    ]
}

// === TLS ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_a_ca_file() {
    delivers_over_tls(&tls_url(tls_front()), ca_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_mutual_tls_delivers_and_a_client_without_a_certificate_is_refused() {
    mutual_tls_delivers_and_refuses_a_client_without_a_certificate(&tls_url(mutual_front())).await;
}

// === SASL ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sasl_plain_delivers() {
    let url = format!("kafka://{}", sasl_front().bootstrap);
    delivers_over_tls(&url, login("PLAIN", PLAIN)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sasl_scram_sha_256_delivers() {
    let url = format!("kafka://{}", sasl_front().bootstrap);
    delivers_over_tls(&url, login("SCRAM-SHA-256", SCRAM_256)).await;
}

/// SCRAM-SHA-512 inside TLS (Kafka's SASL_SSL), the form managed clusters
/// take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sasl_scram_sha_512_over_tls_delivers() {
    let mut args = ca_only();
    args.extend(login("scram-sha-512", SCRAM_512));
    delivers_over_tls(&tls_url(sasl_tls_front()), args).await;
}

/// The password in `COURIER_KAFKA_SASL_PASSWORD` instead of a file: `dlq
/// list` logs in with it, and `send` with a wrong one is refused, naming
/// the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_sasl_password_from_the_environment() {
    let url = format!("kafka://{}", sasl_front().bootstrap);
    let queue = unique("sasl-env");
    let (user, password) = SCRAM_256;
    let with = |secret: &str, args: &[&str]| {
        courier_command()
            .args(args)
            .args(["--source", &url, "--queue", &queue])
            .env("COURIER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
            .env("COURIER_KAFKA_SASL_USERNAME", user)
            .env("COURIER_KAFKA_SASL_PASSWORD", secret)
            .output()
            .unwrap()
    };
    let listed = with(password, &["dlq", "list", "--output", "json"]);
    assert!(listed.status.success(), "{}", text(&listed));
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout).trim(),
        "",
        "a new queue has no dead letters"
    );
    let refused = with("not-the-password", &["send", "hello"]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("refused the SASL SCRAM-SHA-256 login")
            && err.contains("COURIER_KAFKA_SASL_PASSWORD"),
        "{err}"
    );
    assert!(!err.contains("not-the-password"), "{err}");
}

// === OAUTHBEARER ===

/// The access token the identity provider below issues and the front
/// accepts: a JWT (librdkafka reads its `sub` and `exp`; the broker, here
/// the front, judges it).
fn oauth_token() -> String {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN
        .get_or_init(|| {
            let exp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                + 3600;
            let part = |json: String| URL_SAFE_NO_PAD.encode(json);
            format!(
                "{}.{}.{}",
                part(r#"{"alg":"RS256","typ":"JWT"}"#.into()),
                part(format!(
                    r#"{{"sub":"{}","exp":{exp},"iat":{}}}"#,
                    OAUTH_CLIENT.0,
                    exp - 3600
                )),
                URL_SAFE_NO_PAD.encode(unique("signature"))
            )
        })
        .clone()
}

/// An OAuth token endpoint on loopback: client credentials in HTTP Basic
/// (as librdkafka sends them) for [`oauth_token`], 401 for any others.
/// Returns its URL and how many tokens it gave.
async fn identity_provider() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/oauth2/token", listener.local_addr().unwrap());
    let issued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = issued.clone();
    let expected = format!(
        "Basic {}",
        STANDARD.encode(format!("{}:{}", OAUTH_CLIENT.0, OAUTH_CLIENT.1))
    );
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (expected, count) = (expected.clone(), count.clone());
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                let head_end = loop {
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                };
                let head = String::from_utf8_lossy(&request[..head_end]).to_string();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                while request.len() < head_end + length {
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    request.extend_from_slice(&buf[..n]);
                }
                let body = String::from_utf8_lossy(&request[head_end..]).to_string();
                let authorized = head.lines().any(|l| {
                    l.split_once(':').is_some_and(|(name, value)| {
                        name.eq_ignore_ascii_case("authorization") && value.trim() == expected
                    })
                });
                let (status, json) = if authorized && body.contains("grant_type=client_credentials")
                {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    (
                        "200 OK",
                        format!(
                            r#"{{"access_token":"{}","token_type":"bearer","expires_in":3600}}"#,
                            oauth_token()
                        ),
                    )
                } else {
                    (
                        "401 Unauthorized",
                        r#"{"error":"invalid_client"}"#.to_string(),
                    )
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
                    json.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, issued)
}

fn oauth_login(token_url: &str, secret: &str) -> Vec<String> {
    vec![
        "--kafka-sasl-mechanism".into(),
        "OAUTHBEARER".into(),
        "--kafka-sasl-username".into(),
        OAUTH_CLIENT.0.into(),
        "--kafka-sasl-password-file".into(),
        secret_file(secret).display().to_string(),
        "--kafka-oauth-token-url".into(),
        token_url.into(),
        "--kafka-oauth-scope".into(),
        "kafka".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_oauthbearer_with_client_credentials_delivers() {
    let (token_url, issued) = identity_provider().await;
    let mut args = ca_only();
    args.extend(oauth_login(&token_url, OAUTH_CLIENT.1));
    delivers_over_tls(&tls_url(oauth_front()), args).await;
    assert!(
        issued.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no token was fetched from the identity provider"
    );
}

/// A client secret the identity provider refuses ends the start with
/// exit 1, naming the token URL and where the secret came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_oauthbearer_with_a_wrong_client_secret_is_refused_at_start() {
    let (token_url, issued) = identity_provider().await;
    let mut args = ca_only();
    args.extend(oauth_login(&token_url, "not-the-secret"));
    let (code, log, took) = run_ends(&tls_url(oauth_front()), &args, Duration::from_secs(40)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("no OAuth token") && log.contains("--kafka-oauth-token-url"),
        "{log}"
    );
    assert!(!log.contains("not-the-secret"), "{log}");
    assert_eq!(issued.load(std::sync::atomic::Ordering::SeqCst), 0);
    eprintln!("a refused client secret ended the start after {took:?}");
}

// === Refusals ===

/// A wrong password, a broker without SASL, a plaintext client at a TLS
/// listener and a certificate no CA given vouches for: each ends `courier
/// run` with exit 1 and a message naming what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kafka_misconfiguration_ends_the_start_with_what_to_fix() {
    let sasl_url = format!("kafka://{}", sasl_front().bootstrap);
    let (token_url, _) = identity_provider().await;
    let cases: Vec<(&str, String, Vec<String>, &[&str])> = vec![
        (
            "a wrong password",
            sasl_url.clone(),
            login("SCRAM-SHA-512", (SCRAM_512.0, "wrong-password-3b1f")),
            &[
                "refused the SASL SCRAM-SHA-512 login of \"carol\"",
                "--kafka-sasl-username",
                "--kafka-sasl-password-file",
            ],
        ),
        (
            "a token the brokers do not accept",
            tls_url(other_oauth_front()),
            [ca_only(), oauth_login(&token_url, OAUTH_CLIENT.1)].concat(),
            &[
                "refused the OAuth token of client \"courier-client\"",
                "--kafka-oauth-scope",
            ],
        ),
        (
            "a mechanism the broker does not offer",
            tls_url(oauth_front()),
            [ca_only(), login("PLAIN", PLAIN)].concat(),
            &["do not offer SASL PLAIN", "--kafka-sasl-mechanism"],
        ),
        (
            "a broker that takes no SASL login",
            tls_url(tls_front()),
            [ca_only(), login("PLAIN", PLAIN)].concat(),
            &["do not take a SASL login", "--kafka-sasl-mechanism"],
        ),
        (
            "a plaintext client at a TLS listener",
            format!("kafka://{}", tls_front().bootstrap),
            Vec::new(),
            &["kafkas://"],
        ),
        (
            "no CA for the brokers' certificate",
            tls_url(tls_front()),
            Vec::new(),
            &["certificate verify failed", "--tls-ca-file"],
        ),
    ];
    for (what, url, args, says) in cases {
        let (code, log, took) = run_ends(&url, &args, Duration::from_secs(40)).await;
        assert_eq!(code, Some(1), "{what}: {log}");
        for said in says {
            assert!(log.contains(said), "{what}: no {said:?} in {log}");
        }
        assert!(!log.contains("wrong-password-3b1f"), "{what}: {log}");
        eprintln!("{what}: the start ended after {took:?}");
    }
}

/// Bad usage is exit 2 before anything connects, naming the flag.
#[test]
fn kafka_sasl_usage_errors_exit_2() {
    let nobody = "kafka://127.0.0.1:17099";
    // The flags, the variables, the URL and what the message says.
    type Case<'a> = (Vec<String>, Vec<(&'a str, &'a str)>, &'a str, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            vec!["--kafka-sasl-mechanism".into(), "GSSAPI".into()],
            vec![],
            nobody,
            "not a SASL mechanism courier speaks",
        ),
        (
            vec!["--kafka-sasl-mechanism".into(), "PLAIN".into()],
            vec![],
            nobody,
            "--kafka-sasl-username",
        ),
        (
            vec![
                "--kafka-sasl-mechanism".into(),
                "PLAIN".into(),
                "--kafka-sasl-username".into(),
                "alice".into(),
            ],
            vec![],
            nobody,
            "COURIER_KAFKA_SASL_PASSWORD",
        ),
        (
            vec![
                "--kafka-sasl-mechanism".into(),
                "OAUTHBEARER".into(),
                "--kafka-sasl-username".into(),
                "id".into(),
            ],
            vec![("COURIER_KAFKA_SASL_PASSWORD", "s")],
            nobody,
            "--kafka-oauth-token-url",
        ),
        (
            vec!["--kafka-sasl-username".into(), "alice".into()],
            vec![],
            nobody,
            "without --kafka-sasl-mechanism",
        ),
        (
            vec![
                "--kafka-sasl-mechanism".into(),
                "PLAIN".into(),
                "--kafka-sasl-username".into(),
                "alice".into(),
                "--kafka-sasl-password-file".into(),
                "/nonexistent/password".into(),
            ],
            vec![],
            nobody,
            "--kafka-sasl-password-file /nonexistent/password: cannot read it",
        ),
        (
            vec![
                "--kafka-sasl-mechanism".into(),
                "PLAIN".into(),
                "--kafka-sasl-username".into(),
                "alice".into(),
            ],
            vec![("COURIER_KAFKA_SASL_PASSWORD", "pw")],
            "redis://127.0.0.1:6379/0",
            "is for Kafka",
        ),
        (
            vec![],
            vec![],
            "kafka://alice:hunter2@127.0.0.1:17099",
            "--kafka-sasl-username",
        ),
    ];
    for (flags, env, url, says) in cases {
        for (command, last) in [
            (&["run"][..], &[][..]),
            (&["send"], &["x"]),
            (&["dlq", "list"], &[]),
        ] {
            let out = courier_command()
                .args(command)
                .args(["--source", url, "--queue", "q"])
                .args(&flags)
                .args(last)
                .envs(env.iter().copied())
                .output()
                .unwrap();
            assert_eq!(
                out.status.code(),
                Some(2),
                "{command:?} {flags:?}: {}",
                text(&out)
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(says), "{command:?} {flags:?}: {err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }
}

/// With every log at trace level, librdkafka's own debug output included,
/// neither a login that works nor one that is refused shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_kafka_secret_reaches_the_log_at_trace_level() {
    let url = tls_url(sasl_tls_front());
    let app = TestApp::start().await;
    let queue = unique("trace");
    let password_file = secret_file(SCRAM_512.1);
    let mut args = vec![
        "--source".to_string(),
        url.clone(),
        "--queue".into(),
        queue.clone(),
        "--app".into(),
        app.url(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--create".into(),
        "--kafka-sasl-mechanism".into(),
        "SCRAM-SHA-512".into(),
        "--kafka-sasl-username".into(),
        SCRAM_512.0.into(),
        "--kafka-sasl-password-file".into(),
        password_file.display().to_string(),
    ];
    args.extend(ca_only());
    let trace = [
        ("COURIER_LOG_LEVEL", "trace"),
        ("COURIER_KAFKA_DEBUG", "all"),
    ];
    let mut courier = CourierProcess::run_with_env(&args, &trace);
    courier.wait_running().await;
    let mut sasl_env = ca_only();
    sasl_env.extend(login("SCRAM-SHA-512", SCRAM_512));
    let out = send(&url, &queue, &sasl_env, "traced");
    assert!(out.status.success(), "{}", text(&out));
    wait_for(
        "the message to reach the app",
        Duration::from_secs(30),
        async || !app.received_body(b"traced").is_empty(),
    )
    .await;
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}");
    let log = courier.log();
    assert!(
        log.contains("SCRAM-SHA-512") && log.lines().count() > 100,
        "the trace log shows the login: {} lines",
        log.lines().count()
    );
    assert!(!log.contains(SCRAM_512.1), "the password is in the run log");

    let wrong = "wrong-trace-pw-90ac";
    let mut refused = ca_only();
    refused.extend(login("SCRAM-SHA-512", (SCRAM_512.0, wrong)));
    let out = courier_command()
        .args(["dlq", "list", "--source", &url, "--queue", &queue])
        .args(&refused)
        .envs(trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let all = text(&out);
    assert!(all.contains("refused the SASL"), "{all}");
    assert!(!all.contains(wrong), "the wrong password is in the dlq log");
    let listed = dlq_list(&url, &queue, &sasl_env);
    assert!(listed.status.success(), "{}", text(&listed));
}
