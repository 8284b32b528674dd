//! A real browser for the tests: Debian's Chromium, headless, driven over
//! W3C WebDriver through chromedriver (both from `scripts/browser-deps`).
//!
//! The client speaks the protocol itself, as JSON over HTTP/1.1 with the
//! hyper client courier already has, instead of a WebDriver crate: the
//! tests need a dozen commands (navigate, find, click, type, read, run a
//! script, screenshot, alerts), each one request and one JSON answer, and a
//! crate would bring its own HTTP stack and async runtime glue for them.
//!
//! One chromedriver per test binary (started on first use, on a free
//! loopback port, ended when this process ends), and one [`Session`] per
//! test: a Chromium of its own with a fresh profile, quit when the session
//! is dropped. A session dropped by a failing test first saves a screenshot
//! and the page's HTML under `target/tmp/browser-failures/`.
//!
//! Its methods panic with what they were doing, the page's URL and the
//! start of its text, as the other helpers here do: a test reads
//! `page.find("#x").await.click().await`, and a failure says which page
//! lacked `#x`. [`Session::try_find`] and [`Session::find_all`] are for
//! asserting that something is absent.
//!
//! Server-rendered content is there once [`Session::goto`] returns (the
//! page has loaded); anything a script adds later needs a
//! `wait_for_*` helper, which polls until the condition holds or the
//! session's wait timeout ([`Session::set_wait_timeout`]) passes.
//!
//! `CHROMEDRIVER` and `CHROMIUM` name other binaries than Debian's
//! `chromedriver` on the PATH and the `/usr/bin/chromium` it starts.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// The key W3C WebDriver marks an element reference with in JSON.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The key code WebDriver types as Enter (in [`Element::send_keys`]).
pub const ENTER: &str = "\u{E007}";
/// The key code for Tab.
pub const TAB: &str = "\u{E004}";

/// How long one WebDriver command may take. Starting Chromium is the
/// slowest (about a second here, more on a loaded 2-core CI machine); a
/// command that takes longer means chromedriver or the browser hangs.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// The default of [`Session::set_wait_timeout`].
const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// How often the `wait_for_*` helpers check again.
const POLL: Duration = Duration::from_millis(50);

/// The window every session starts with, so that screenshots (and layouts
/// that depend on the width) are the same on every machine.
pub const WINDOW: (u32, u32) = (1280, 800);

// === chromedriver ===

/// A running chromedriver; it ends when this process closes its stdin,
/// which also happens when this process dies (a static is never dropped).
pub struct ChromeDriver {
    child: Child,
    pub port: u16,
}

impl ChromeDriver {
    /// Starts chromedriver (`$CHROMEDRIVER`, or `chromedriver` on the PATH)
    /// on a free loopback port, and waits until it answers.
    pub fn start() -> Self {
        let binary = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        // Checked here because the shell below would only say that the port
        // never answered.
        let found = std::process::Command::new(&binary)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            found,
            "{binary} is missing: scripts/browser-deps installs Debian's chromium and \
             chromium-driver (or set CHROMEDRIVER to its path)"
        );
        // chromedriver accepts connections from loopback only by default.
        let (child, port) = super::server_process::start_server(
            &format!("'{binary}' --port={{port}} --log-level=WARNING"),
            &[],
            "chromedriver",
            Duration::from_secs(30),
        );
        Self { child, port }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for ChromeDriver {
    /// Closing the shell's stdin ends chromedriver (server_process.rs).
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// The chromedriver this test binary shares; every session is a browser of
/// its own on it.
pub fn shared_chromedriver() -> &'static ChromeDriver {
    static SHARED: OnceLock<ChromeDriver> = OnceLock::new();
    SHARED.get_or_init(ChromeDriver::start)
}

// === The wire ===

/// A failed WebDriver command: the protocol's error code (`no such
/// element`, `stale element reference`, `no such alert`, ...) and message.
#[derive(Debug, Clone)]
pub struct WebDriverError {
    pub command: String,
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for WebDriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The message's first line: chromedriver appends its build and the
        // browser's stack trace, which say nothing about the test.
        let message = self.message.lines().next().unwrap_or_default();
        write!(f, "{}: {}: {message}", self.command, self.code)
    }
}

/// One session's address on chromedriver and an HTTP client for it.
struct Wire {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `http://127.0.0.1:PORT/session/ID`
    base: String,
}

impl Wire {
    fn new(base: String) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base,
        }
    }

    /// `method` on `base` + `path` with `body` as JSON; the answer's
    /// `value`, or the protocol's error.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, WebDriverError> {
        let command = format!("{method} {path}");
        let failed = |code: &str, message: String| WebDriverError {
            command: command.clone(),
            code: code.into(),
            message,
        };
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json; charset=utf-8")
            .body(Full::new(Bytes::from(body)))
            .expect("a WebDriver request");
        let exchange = async {
            let response = self.client.request(request).await?;
            let status = response.status();
            let bytes = response.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, bytes))
        };
        let (status, bytes) = match tokio::time::timeout(COMMAND_TIMEOUT, exchange).await {
            Err(_) => {
                return Err(failed(
                    "timeout",
                    format!("no answer in {COMMAND_TIMEOUT:?}"),
                ));
            }
            Ok(Err(e)) => return Err(failed("http", e.to_string())),
            Ok(Ok(answer)) => answer,
        };
        let answer: Value = serde_json::from_slice(&bytes).map_err(|e| {
            failed(
                "bad answer",
                format!("{e}: {}", String::from_utf8_lossy(&bytes)),
            )
        })?;
        let value = answer.get("value").cloned().unwrap_or(Value::Null);
        // Every error, whatever its HTTP status, is `{"value": {"error": ..}}`.
        if let Some(code) = value.get("error").and_then(Value::as_str) {
            let message = value["message"].as_str().unwrap_or_default().to_string();
            return Err(failed(code, message));
        }
        if !status.is_success() {
            return Err(failed(status.as_str(), answer.to_string()));
        }
        Ok(value)
    }
}

// === Sessions ===

/// What a session is started with; [`Session::start`] takes the defaults.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// The window's outer size in CSS pixels.
    pub window: (u32, u32),
    /// Arguments for Chromium beyond the ones every session gets.
    pub extra_args: Vec<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            window: WINDOW,
            extra_args: Vec::new(),
        }
    }
}

/// A headless Chromium driven through WebDriver; quit on drop.
pub struct Session {
    wire: Arc<Wire>,
    id: String,
    /// How long the `wait_for_*` helpers poll.
    wait: Duration,
    /// The test's name (its thread's), for the files of a failure.
    label: String,
    /// The browser's profile; removed after the browser has quit.
    _profile: tempfile::TempDir,
}

impl Session {
    /// A new browser on the shared chromedriver, with a window of
    /// [`WINDOW`].
    pub async fn start() -> Self {
        Self::start_with(SessionOptions::default()).await
    }

    pub async fn start_with(options: SessionOptions) -> Self {
        let driver = shared_chromedriver();
        let profile = tempfile::Builder::new()
            .prefix("courier-chromium-")
            .tempdir()
            .expect("a temporary Chromium profile");
        let (width, height) = options.window;
        let mut args = vec![
            // The tests run as root in CI, where Chromium refuses to start
            // with its sandbox; the pages are the tests' own.
            "--no-sandbox".to_string(),
            "--headless=new".into(),
            // No GPU on the machines; software rendering from the start
            // instead of a failed probe.
            "--disable-gpu".into(),
            // /dev/shm is 64 MB in a default container: Chromium crashes
            // when it runs out; /tmp instead.
            "--disable-dev-shm-usage".into(),
            format!("--user-data-dir={}", profile.path().display()),
            format!("--window-size={width},{height}"),
            // The same pixels on every machine: no HiDPI scaling, no
            // scrollbars that differ by theme.
            "--force-device-scale-factor=1".into(),
            "--hide-scrollbars".into(),
            "--lang=en-US".into(),
            // No calls home: the machines have no internet, and a request
            // that waits for it slows the browser's start.
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-extensions".into(),
        ];
        args.extend(options.extra_args);
        let mut chrome_options = json!({ "args": args });
        if let Ok(binary) = std::env::var("CHROMIUM") {
            chrome_options["binary"] = json!(binary);
        }
        let capabilities = json!({
            "capabilities": {
                "alwaysMatch": {
                    "goog:chromeOptions": chrome_options,
                    // A test handles every alert itself; one left open
                    // fails the next command, instead of being dismissed.
                    "unhandledPromptBehavior": "ignore",
                    "timeouts": { "implicit": 0, "pageLoad": 30_000, "script": 30_000 },
                }
            }
        });
        let new = Wire::new(driver.url());
        let answer = new
            .call(Method::POST, "/session", Some(capabilities))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "start a headless Chromium through chromedriver at {}: {e}",
                    driver.url()
                )
            });
        let id = answer["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a new session's id in {answer}"))
            .to_string();
        // libtest runs each test on a thread named after it (on the main
        // thread with --test-threads=1); a spawned task is on a worker.
        let label = std::thread::current()
            .name()
            .filter(|name| !["main", "tokio-runtime-worker"].contains(name))
            .map(|name| name.replace("::", "-"))
            .unwrap_or_else(|| format!("session-{id}"));
        Self {
            wire: Arc::new(Wire::new(format!("{}/session/{id}", driver.url()))),
            id,
            wait: DEFAULT_WAIT,
            label,
            _profile: profile,
        }
    }

    /// The session's id on chromedriver.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How long the `wait_for_*` helpers wait before they fail (10 s).
    pub fn set_wait_timeout(&mut self, wait: Duration) {
        self.wait = wait;
    }

    /// A command whose failure fails the test, with the page it was on.
    async fn command(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        match self.wire.call(method, path, body).await {
            Ok(value) => value,
            Err(e) => panic!("{e}\n{}", self.describe_page().await),
        }
    }

    // --- Navigation ---

    /// Loads `url` and returns once the page has loaded.
    pub async fn goto(&self, url: &str) {
        if let Err(e) = self
            .wire
            .call(Method::POST, "/url", Some(json!({ "url": url })))
            .await
        {
            panic!("open {url}: {e}\n{}", self.describe_page().await);
        }
    }

    pub async fn current_url(&self) -> String {
        let url = self.command(Method::GET, "/url", None).await;
        url.as_str().unwrap_or_default().to_string()
    }

    pub async fn title(&self) -> String {
        let title = self.command(Method::GET, "/title", None).await;
        title.as_str().unwrap_or_default().to_string()
    }

    /// The page's HTML as the browser has it now (scripts' changes
    /// included).
    pub async fn source(&self) -> String {
        let source = self.command(Method::GET, "/source", None).await;
        source.as_str().unwrap_or_default().to_string()
    }

    pub async fn back(&self) {
        self.command(Method::POST, "/back", Some(json!({}))).await;
    }

    pub async fn refresh(&self) {
        self.command(Method::POST, "/refresh", Some(json!({})))
            .await;
    }

    /// The visible text of the whole page (`document.body.innerText`).
    pub async fn text(&self) -> String {
        let text = self
            .execute(
                "return document.body ? document.body.innerText : '';",
                vec![],
            )
            .await;
        text.as_str().unwrap_or_default().to_string()
    }

    // --- Elements ---

    /// The first element `css` selects, or None.
    pub async fn try_find(&self, css: &str) -> Option<Element> {
        let body = json!({ "using": "css selector", "value": css });
        match self.wire.call(Method::POST, "/element", Some(body)).await {
            Ok(value) => Some(self.element(&value, css)),
            Err(e) if e.code == "no such element" => None,
            Err(e) => panic!("find {css:?}: {e}\n{}", self.describe_page().await),
        }
    }

    /// The first element `css` selects; fails the test, saying which page
    /// it was not on, when there is none.
    pub async fn find(&self, css: &str) -> Element {
        match self.try_find(css).await {
            Some(element) => element,
            None => panic!("no element matches {css:?}\n{}", self.describe_page().await),
        }
    }

    /// Every element `css` selects, in document order (none is no error).
    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        let body = json!({ "using": "css selector", "value": css });
        let found = self.command(Method::POST, "/elements", Some(body)).await;
        found
            .as_array()
            .map(|all| all.iter().map(|e| self.element(e, css)).collect())
            .unwrap_or_default()
    }

    fn element(&self, value: &Value, css: &str) -> Element {
        let id = value[ELEMENT_KEY]
            .as_str()
            .unwrap_or_else(|| panic!("an element reference in {value}"));
        Element {
            wire: self.wire.clone(),
            id: id.to_string(),
            css: css.to_string(),
        }
    }

    // --- Waiting ---

    /// Polls `check` until it gives Some, and returns that; after the wait
    /// timeout, fails the test with `what` it waited for and the page.
    ///
    /// `check` is a closure returning a future, `|| async move { .. }` over
    /// a `&Session` (`let page = &session;`), rather than an async closure:
    /// rustc cannot yet prove an async closure's borrowing future `Send`,
    /// and a test that runs a session in `tokio::spawn` needs that.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        match self.try_wait_for(what, check).await {
            Ok(found) => found,
            Err(timed_out) => panic!("{timed_out}"),
        }
    }

    /// [`Session::wait_for`], with the failure's message as an error
    /// instead of a panic: for a test that expects the wait to fail.
    pub async fn try_wait_for<T, F, Fut>(&self, what: &str, mut check: F) -> Result<T, String>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let start = Instant::now();
        loop {
            if let Some(found) = check().await {
                return Ok(found);
            }
            if start.elapsed() >= self.wait {
                let page = self.describe_page().await;
                return Err(format!("waited {:?} for {what}\n{page}", self.wait));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The first element `css` selects, once there is one.
    pub async fn wait_for_element(&self, css: &str) -> Element {
        self.wait_for(&format!("an element matching {css:?}"), || async move {
            self.try_find(css).await
        })
        .await
    }

    /// The first element `css` selects whose text contains `text`, once
    /// there is one.
    pub async fn wait_for_text(&self, css: &str, text: &str) -> Element {
        let what = format!("an element matching {css:?} with the text {text:?}");
        self.wait_for(&what, || async move {
            for element in self.find_all(css).await {
                // A script may replace the element between the two calls.
                if let Ok(found) = element.try_text().await
                    && found.contains(text)
                {
                    return Some(element);
                }
            }
            None
        })
        .await
    }

    /// Waits until no element matches `css` (a row removed, a dialog
    /// closed).
    pub async fn wait_for_absent(&self, css: &str) {
        self.wait_for(&format!("no element to match {css:?}"), || async move {
            self.find_all(css).await.is_empty().then_some(())
        })
        .await
    }

    /// Waits until the current URL contains `part` (after a submit or a
    /// redirect), and returns it.
    pub async fn wait_for_url(&self, part: &str) -> String {
        self.wait_for(&format!("a URL containing {part:?}"), || async move {
            let url = self.current_url().await;
            url.contains(part).then_some(url)
        })
        .await
    }

    // --- Scripts ---

    /// Runs `script` as a function's body in the page (`arguments[i]` are
    /// `args`; pass an element as [`Element::arg`]) and returns what it
    /// returns, as JSON (an element returned comes back as a reference).
    pub async fn execute(&self, script: &str, args: Vec<Value>) -> Value {
        let body = json!({ "script": script, "args": args });
        match self
            .wire
            .call(Method::POST, "/execute/sync", Some(body))
            .await
        {
            Ok(value) => value,
            // Not describe_page: it runs a script too, and the page may be
            // what fails.
            Err(e) => panic!("run the script {script:?}: {e}"),
        }
    }

    // --- Window and screenshots ---

    /// Resizes the window (its outer size, in CSS pixels; the page gets
    /// less: headless Chromium keeps room for a window's frame).
    pub async fn set_window_size(&self, width: u32, height: u32) {
        let body = json!({ "width": width, "height": height });
        self.command(Method::POST, "/window/rect", Some(body)).await;
    }

    /// Resizes the window so that the page's viewport, and so a
    /// [`Session::screenshot`], is `width` x `height` CSS pixels: what a
    /// screenshot for the docs wants. WebDriver sets only the outer size,
    /// so this measures the frame and adds it.
    pub async fn set_viewport_size(&self, width: u32, height: u32) {
        let viewport = "return [window.innerWidth, window.innerHeight];";
        let mut window = (width, height);
        // Twice at most: the frame is the same for every size, but a
        // window manager may round the first attempt.
        for _ in 0..2 {
            self.set_window_size(window.0, window.1).await;
            let inner = self.execute(viewport, vec![]).await;
            let inner = (
                inner[0].as_u64().unwrap_or_default() as u32,
                inner[1].as_u64().unwrap_or_default() as u32,
            );
            if inner == (width, height) {
                return;
            }
            window = (
                (window.0 + width).saturating_sub(inner.0),
                (window.1 + height).saturating_sub(inner.1),
            );
        }
        let inner = self.execute(viewport, vec![]).await;
        panic!("a viewport of {width}x{height}: it is {inner} in a window of {window:?}");
    }

    /// The viewport as a PNG, written to `path` (its directory is made);
    /// returns the PNG's bytes.
    pub async fn screenshot(&self, path: &Path) -> Vec<u8> {
        let png = decode_png(self.command(Method::GET, "/screenshot", None).await);
        write_file(path, &png);
        png
    }

    // --- Alerts (alert, confirm, prompt) ---

    /// The open alert's text, or None when there is none.
    pub async fn alert_text(&self) -> Option<String> {
        match self.wire.call(Method::GET, "/alert/text", None).await {
            Ok(text) => Some(text.as_str().unwrap_or_default().to_string()),
            Err(e) if e.code == "no such alert" => None,
            Err(e) => panic!("read the alert: {e}"),
        }
    }

    /// Waits for an alert and returns its text.
    pub async fn wait_for_alert(&self) -> String {
        self.wait_for("an alert", || async move { self.alert_text().await })
            .await
    }

    /// Types `text` into the open prompt.
    pub async fn answer_prompt(&self, text: &str) {
        let body = json!({ "text": text });
        if let Err(e) = self
            .wire
            .call(Method::POST, "/alert/text", Some(body))
            .await
        {
            panic!("type into the prompt: {e}");
        }
    }

    /// Presses OK on the open alert, confirm or prompt.
    pub async fn accept_alert(&self) {
        let accepted = self
            .wire
            .call(Method::POST, "/alert/accept", Some(json!({})));
        if let Err(e) = accepted.await {
            panic!("accept the alert: {e}");
        }
    }

    /// Presses Cancel on the open confirm or prompt.
    pub async fn dismiss_alert(&self) {
        let dismissed = self
            .wire
            .call(Method::POST, "/alert/dismiss", Some(json!({})));
        if let Err(e) = dismissed.await {
            panic!("dismiss the alert: {e}");
        }
    }

    // --- Failures ---

    /// Where the browser is, for a failure's message: the URL, the title
    /// and the start of the page's text. Never fails itself: an alert that
    /// is open blocks scripts, and the page may be gone.
    pub async fn describe_page(&self) -> String {
        describe(&self.wire).await
    }
}

/// [`Session::describe_page`] on `wire` (also used while dropping).
async fn describe(wire: &Wire) -> String {
    /// Enough of the page to recognise it (an error page, a login form).
    const SNIPPET: usize = 600;
    let url = match wire.call(Method::GET, "/url", None).await {
        Ok(url) => url.as_str().unwrap_or_default().to_string(),
        Err(e) => return format!("(the page is unknown: {e})"),
    };
    if let Ok(text) = wire.call(Method::GET, "/alert/text", None).await {
        return format!("page: {url}\nan alert is open: {text}");
    }
    let script = json!({
        "script": "return [document.title, document.body ? document.body.innerText : ''];",
        "args": [],
    });
    let (title, text) = match wire.call(Method::POST, "/execute/sync", Some(script)).await {
        Ok(found) => (
            found[0].as_str().unwrap_or_default().to_string(),
            found[1].as_str().unwrap_or_default().to_string(),
        ),
        Err(e) => return format!("page: {url}\n(its text is unknown: {e})"),
    };
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut snippet: String = text.chars().take(SNIPPET).collect();
    if snippet.len() < text.len() {
        snippet.push_str(" …");
    }
    format!("page: {url} (title {title:?})\npage text: {snippet}")
}

impl Drop for Session {
    /// Quits the browser; when the test is failing, first saves what the
    /// browser showed. Drop cannot await, and the test's runtime may be the
    /// current-thread one this drop blocks, so the requests go from a
    /// thread of their own with a runtime and an HTTP client of its own.
    fn drop(&mut self) {
        let base = self.wire.base.clone();
        let failing = std::thread::panicking();
        let label = self.label.clone();
        let quit = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to quit the browser");
            runtime.block_on(async {
                let wire = Wire::new(base);
                if failing {
                    save_failure(&wire, &label).await;
                }
                if let Err(e) = wire.call(Method::DELETE, "", None).await {
                    eprintln!("browser: quitting the session failed: {e}");
                }
            });
        });
        let _ = quit.join();
    }
}

/// A failing test's last screenshot and HTML, under
/// `target/tmp/browser-failures/`, named after the test.
async fn save_failure(wire: &Wire, label: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("browser-failures");
    // An open alert blocks both; it is in the panic's message already.
    let _ = wire
        .call(Method::POST, "/alert/dismiss", Some(json!({})))
        .await;
    if let Ok(png) = wire.call(Method::GET, "/screenshot", None).await {
        let path = dir.join(format!("{label}.png"));
        write_file(&path, &decode_png(png));
        eprintln!("browser: the page at the failure: {}", path.display());
    }
    if let Ok(Value::String(html)) = wire.call(Method::GET, "/source", None).await {
        let path = dir.join(format!("{label}.html"));
        write_file(&path, html.as_bytes());
        eprintln!("browser: its HTML: {}", path.display());
    }
}

fn decode_png(value: Value) -> Vec<u8> {
    let encoded = value.as_str().expect("a screenshot as base64");
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .expect("a screenshot's base64")
}

fn write_file(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    }
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

// === Elements ===

/// An element of the page a session has open. It goes stale when the page
/// changes (a navigation, or a script replacing it): find it again then.
#[derive(Clone)]
pub struct Element {
    wire: Arc<Wire>,
    id: String,
    /// The selector it was found with, for messages.
    css: String,
}

impl std::fmt::Debug for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Element({:?})", self.css)
    }
}

impl Element {
    /// `/element/ID` + `path` on the session; a failure names the element
    /// and the page.
    async fn command(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        match self.try_command(method, path, body).await {
            Ok(value) => value,
            Err(e) => panic!(
                "the element {:?}: {e}\n{}",
                self.css,
                describe(&self.wire).await
            ),
        }
    }

    async fn try_command(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, WebDriverError> {
        let path = format!("/element/{}{path}", self.id);
        self.wire.call(method, &path, body).await
    }

    /// The element as an argument of [`Session::execute`].
    pub fn arg(&self) -> Value {
        json!({ ELEMENT_KEY: self.id })
    }

    /// A click in the element's centre, as a user's (scrolled into view;
    /// fails when something covers it).
    pub async fn click(&self) {
        self.command(Method::POST, "/click", Some(json!({}))).await;
    }

    /// Types `text` into the element (after what it holds); [`ENTER`] and
    /// [`TAB`] are keys.
    pub async fn send_keys(&self, text: &str) {
        let body = json!({ "text": text });
        self.command(Method::POST, "/value", Some(body)).await;
    }

    /// Empties an input or a textarea.
    pub async fn clear(&self) {
        self.command(Method::POST, "/clear", Some(json!({}))).await;
    }

    /// The rendered text, as a user sees it (hidden parts left out).
    pub async fn text(&self) -> String {
        match self.try_text().await {
            Ok(text) => text,
            Err(e) => panic!(
                "the element {:?}: {e}\n{}",
                self.css,
                describe(&self.wire).await
            ),
        }
    }

    async fn try_text(&self) -> Result<String, WebDriverError> {
        let text = self.try_command(Method::GET, "/text", None).await?;
        Ok(text.as_str().unwrap_or_default().to_string())
    }

    /// The HTML attribute `name` as written (None when absent).
    pub async fn attribute(&self, name: &str) -> Option<String> {
        let path = format!("/attribute/{name}");
        let value = self.command(Method::GET, &path, None).await;
        value.as_str().map(str::to_string)
    }

    /// The DOM property `name` as it is now (an input's `value`, a
    /// checkbox's `checked`).
    pub async fn property(&self, name: &str) -> Value {
        let path = format!("/property/{name}");
        self.command(Method::GET, &path, None).await
    }

    pub async fn is_displayed(&self) -> bool {
        let shown = self.command(Method::GET, "/displayed", None).await;
        shown.as_bool().unwrap_or(false)
    }

    pub async fn is_enabled(&self) -> bool {
        let enabled = self.command(Method::GET, "/enabled", None).await;
        enabled.as_bool().unwrap_or(false)
    }

    /// The first element `css` selects inside this one.
    pub async fn find(&self, css: &str) -> Element {
        let body = json!({ "using": "css selector", "value": css });
        let value = self.command(Method::POST, "/element", Some(body)).await;
        self.child(&value, css)
    }

    /// Every element `css` selects inside this one.
    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        let body = json!({ "using": "css selector", "value": css });
        let found = self.command(Method::POST, "/elements", Some(body)).await;
        found
            .as_array()
            .map(|all| all.iter().map(|e| self.child(e, css)).collect())
            .unwrap_or_default()
    }

    fn child(&self, value: &Value, css: &str) -> Element {
        let id = value[ELEMENT_KEY]
            .as_str()
            .unwrap_or_else(|| panic!("an element reference in {value}"));
        Element {
            wire: self.wire.clone(),
            id: id.to_string(),
            css: format!("{} {css}", self.css),
        }
    }

    /// Just this element as a PNG, written to `path`; returns the bytes.
    pub async fn screenshot(&self, path: &Path) -> Vec<u8> {
        let png = decode_png(self.command(Method::GET, "/screenshot", None).await);
        write_file(path, &png);
        png
    }
}

/// The width and height a PNG's header gives, or None when `bytes` is not
/// a PNG.
pub fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    // The signature, then the IHDR chunk: length, "IHDR", width, height.
    if bytes.len() < 24 || !bytes.starts_with(SIGNATURE) || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let width = u32::from_be_bytes(bytes[16..20].try_into().ok()?);
    let height = u32::from_be_bytes(bytes[20..24].try_into().ok()?);
    Some((width, height))
}
