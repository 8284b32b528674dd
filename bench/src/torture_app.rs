//! The torture run's app (`courier-bench torture-app`, started as a child so
//! the nemesis can SIGSTOP and SIGKILL it): it answers each message as its
//! [`Plan`] says, decided from the seed and the message's id alone, so the
//! checker knows what the outcome should be, and appends every delivery it
//! saw to a log before it answers.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;

/// The message header (and body prefix) that carries a torture id.
pub const ID_HEADER: &str = "x-torture-id";
/// Every id is this prefix and eight digits, in a header and in the body.
pub const ID_PREFIX: &str = "tqid-";

pub fn id_of(n: u64) -> String {
    format!("{ID_PREFIX}{n:08}")
}

/// The ids (as numbers) found anywhere in `bytes`.
pub fn ids_in(bytes: &[u8], out: &mut impl Extend<u64>) {
    let p = ID_PREFIX.as_bytes();
    let mut at = 0;
    while let Some(i) = memfind(&bytes[at..], p) {
        let start = at + i + p.len();
        if let Some(digits) = bytes.get(start..start + 8)
            && digits.iter().all(u8::is_ascii_digit)
        {
            let n = digits
                .iter()
                .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
            out.extend([n]);
        }
        at = start;
    }
}

fn memfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// SplitMix64: the harness's one source of randomness, seeded.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut r = Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next();
        r
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// How the app answers one message, by the attempt courier says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// 200 at once.
    Ok,
    /// This 4xx every time: a dead letter, `permanent-status`.
    Permanent(u16),
    /// `code` (408, 429 with Retry-After, 500, 503) for the first `fails`
    /// attempts, then 200.
    Flaky { fails: u32, code: u16 },
    /// This 5xx every time: a dead letter, `attempts-exhausted`.
    Poison(u16),
    /// The connection closed without an answer for the first `fails`
    /// attempts, then 200.
    Reset { fails: u32 },
    /// An answer after the policy's timeout for the first `fails` attempts,
    /// then 200 at once.
    Slow { fails: u32 },
}

impl Plan {
    pub fn of(seed: u64, n: u64) -> Plan {
        let mut r = Rng::new(seed, n.wrapping_add(1 << 40));
        match r.below(100) {
            0..60 => Plan::Ok,
            60..68 => Plan::Permanent([400, 404, 409, 410, 422][r.below(5) as usize]),
            68..82 => Plan::Flaky {
                fails: r.range(1, 2) as u32,
                code: match r.below(10) {
                    0 => 429,
                    1..3 => 408,
                    3..6 => 500,
                    _ => 503,
                },
            },
            82..86 => Plan::Poison([500, 503][r.below(2) as usize]),
            86..93 => Plan::Reset {
                fails: r.range(1, 2) as u32,
            },
            _ => Plan::Slow { fails: 1 },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Plan::Ok => "ok",
            Plan::Permanent(_) => "permanent",
            Plan::Flaky { .. } => "flaky",
            Plan::Poison(_) => "poison",
            Plan::Reset { .. } => "reset",
            Plan::Slow { .. } => "slow",
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct AppArgs {
    #[arg(long)]
    pub port: u16,
    #[arg(long)]
    pub seed: u64,
    /// Where every delivery is appended: `id attempt answer [anomaly]`.
    #[arg(long)]
    pub log: PathBuf,
    /// How long a slow answer waits (past the longest policy timeout).
    #[arg(long, default_value_t = 4000)]
    pub slow_ms: u64,
    /// The settle period: 200 to everything but the poisoned messages.
    #[arg(long)]
    pub settle: bool,
}

struct Shared {
    args: AppArgs,
    log: Mutex<std::fs::File>,
}

/// What the app answers, the way it is written in its log.
enum Answer {
    Status(u16),
    Reset,
    Slow,
}

pub fn run(args: AppArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&args.log)?;
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", args.port)).await {
                Ok(l) => break l,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let shared = Arc::new(Shared {
            args,
            log: Mutex::new(log),
        });
        crate::app::serve(
            listener,
            |builder| {
                // Up to the corpus's 2,000 headers and its 60 KiB value.
                builder.max_headers(8192).max_buf_size(4 << 20);
            },
            move |request| handle(shared.clone(), request),
        )
        .await;
        Ok(())
    })
}

#[derive(Debug)]
struct Reset;
impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reset on purpose")
    }
}
impl std::error::Error for Reset {}

async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Reset> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let attempt: u32 = header("courier-attempt")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let header_id = header(ID_HEADER);
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut body_ids = Vec::new();
    ids_in(&body, &mut body_ids);
    let mut anomaly = String::new();
    let id = match (header_id.as_deref(), body_ids.first()) {
        (Some(h), Some(&b)) => {
            if h != id_of(b) {
                anomaly = format!("header-body-mismatch:{h}");
            }
            Some(b)
        }
        (None, Some(&b)) => Some(b),
        (Some(h), None) => {
            anomaly = "body-without-id".into();
            let mut v = Vec::new();
            ids_in(h.as_bytes(), &mut v);
            v.first().copied()
        }
        (None, None) => None,
    };
    let Some(n) = id else {
        write_log(&shared, "none", attempt, "200", "no-id");
        return Ok(answer(200, None));
    };
    let args = &shared.args;
    let plan = Plan::of(args.seed, n);
    let early = |fails: u32| !args.settle && attempt <= fails;
    let decided = match plan {
        Plan::Ok => Answer::Status(200),
        Plan::Permanent(code) | Plan::Poison(code) => Answer::Status(code),
        Plan::Flaky { fails, code } if early(fails) => Answer::Status(code),
        Plan::Reset { fails } if early(fails) => Answer::Reset,
        Plan::Slow { fails } if early(fails) => Answer::Slow,
        _ => Answer::Status(200),
    };
    let written = match &decided {
        Answer::Status(code) => code.to_string(),
        Answer::Reset => "reset".into(),
        Answer::Slow => "slow".into(),
    };
    // Written before the answer: a kill between the two leaves a record of
    // an answer courier never saw, never an answer without a record.
    write_log(&shared, &id_of(n), attempt, &written, &anomaly);
    match decided {
        Answer::Status(code) => {
            let retry_after = (code == 429 || (code == 503 && n % 2 == 0)).then_some("1");
            Ok(answer(code, retry_after))
        }
        Answer::Reset => Err(Reset),
        Answer::Slow => {
            tokio::time::sleep(Duration::from_millis(args.slow_ms)).await;
            Ok(answer(200, None))
        }
    }
}

fn answer(code: u16, retry_after: Option<&'static str>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(format!("torture answer {code}"))));
    *response.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    if let Some(v) = retry_after {
        response
            .headers_mut()
            .insert("retry-after", http::HeaderValue::from_static(v));
    }
    response
}

fn write_log(shared: &Shared, id: &str, attempt: u32, answer: &str, anomaly: &str) {
    let line = format!("{id}\t{attempt}\t{answer}\t{anomaly}\n");
    let mut file = shared.log.lock().unwrap_or_else(|e| e.into_inner());
    // One write of an O_APPEND file per line.
    let _ = file.write_all(line.as_bytes());
}

/// One line of the app's log.
#[derive(Debug, Clone)]
pub struct Seen {
    pub n: u64,
    pub attempt: u32,
    /// The status, or 0 for a reset, 1 for a slow answer.
    pub answer: u16,
    pub anomaly: String,
}

pub const RESET: u16 = 0;
pub const SLOW: u16 = 1;

pub fn read_log(path: &std::path::Path) -> Vec<Seen> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut f = line.split('\t');
            let id = f.next()?;
            let attempt = f.next()?.parse().ok()?;
            let answer = match f.next()? {
                "reset" => RESET,
                "slow" => SLOW,
                s => s.parse().ok()?,
            };
            let anomaly = f.next()?.to_string();
            let mut ids = Vec::new();
            ids_in(id.as_bytes(), &mut ids);
            Some(Seen {
                n: ids.first().copied().unwrap_or(u64::MAX),
                attempt,
                answer,
                anomaly,
            })
        })
        .collect()
}
