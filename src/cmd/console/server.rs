//! The console's HTTP side: routes, the token, the guard on
//! state-changing requests, and the headers every answer carries.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::pages::{self, Page};
use super::{Console, Queue};
use crate::cmd::dlq::audit::Auditor;
use crate::cmd::dlq::filter::{Walk, select};
use crate::cmd::dlq::jobs::{self, Bulk, Kind};
use crate::cmd::dlq::{Filter, Selection, edit};
use crate::expr::Expr;

/// The cookie a browser carries once it gave the token on the login page.
const SESSION_COOKIE: &str = "courier-console";
/// The largest request body read (an edit's patch is the largest).
const BODY_MAX: usize = 256 * 1024;
/// Dead letters on a page.
const PAGE: usize = 50;
/// At most this many letters are read to count a queue's letters by
/// reason and status, so a page of a million-letter queue stays quick; the
/// page says when the count stopped there.
const COUNT_AT_MOST: usize = 5_000;

/// Every answer's headers: nothing from elsewhere, no framing, no
/// sniffing, no referrer to other sites, no caching of what may hold a
/// dead letter.
const SECURITY_HEADERS: [(&str, &str); 7] = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
         connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    // Not no-referrer: under it a browser sends `Origin: null` with the
    // console's own forms, and the origin check below needs the origin.
    ("referrer-policy", "same-origin"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
    ("cache-control", "no-store"),
];

/// Serves until `stop`. Connections are tasks of this thread (a
/// `LocalSet`): a page's walk over a queue is a future the compiler cannot
/// prove `Send` for every lifetime it borrows, and a console serves a few
/// operators, not a load.
pub(super) async fn serve(listener: TcpListener, console: Arc<Console>, stop: CancellationToken) {
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async move {
            loop {
                let stream = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            eprintln!("console: accepting a connection failed: {e}");
                            continue;
                        }
                    },
                };
                let (console, stop) = (console.clone(), stop.clone());
                tokio::task::spawn_local(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let console = console.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(secured(answer(&console, req).await))
                        }
                    });
                    let connection = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    tokio::select! {
                        _ = connection => {}
                        _ = stop.cancelled() => {}
                    }
                });
            }
        })
        .await;
}

fn secured(mut response: Response<Full<Bytes>>) -> Response<Full<Bytes>> {
    let headers = response.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        headers.insert(name, header::HeaderValue::from_static(value));
    }
    response
}

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(body.into()))
        .unwrap_or_default()
}

fn html(status: StatusCode, page: String) -> Response<Full<Bytes>> {
    respond(status, "text/html; charset=utf-8", page)
}

fn see_other(to: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::SEE_OTHER)
        .header(header::LOCATION, to)
        .body(Full::default())
        .unwrap_or_default()
}

/// A page saying what went wrong, with the status that says it too.
fn problem(console: &Console, status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    html(status, pages::problem(console, status, text))
}

/// The session cookie's value for `token`: an HMAC of a fixed text under
/// the token, so the cookie proves the token without being it.
fn session_of(token: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let tag = ring::hmac::sign(&key, b"courier-console-session");
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether the request carries the token: the bearer header, or the
/// cookie the login page set.
fn authorized(console: &Console, req: &Request<Incoming>) -> bool {
    let Some(token) = &console.token else {
        return true;
    };
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer.is_some_and(|b| same(b.trim(), token)) {
        return true;
    }
    let session = session_of(token);
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(name, value)| name == SESSION_COOKIE && same(value, &session))
}

/// Whether a state-changing request comes from the console's own page: a
/// browser says where a request comes from (`Sec-Fetch-Site`, `Origin`),
/// and a page of another origin cannot read the form token to send back.
fn same_origin(req: &Request<Incoming>) -> bool {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    if header("sec-fetch-site").is_some_and(|site| site != "same-origin" && site != "none") {
        return false;
    }
    match (header("origin"), header("host")) {
        (Some(origin), Some(host)) => {
            origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                == Some(host)
        }
        (Some(_), None) => false,
        (None, _) => true,
    }
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

/// A form body: each name's values, in order.
struct Form(Vec<(String, String)>);

impl Form {
    fn one(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.trim().is_empty())
    }

    fn all(&self, name: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .collect()
    }
}

async fn form(req: Request<Incoming>) -> Result<Form, StatusCode> {
    let body = Limited::new(req.into_body(), BODY_MAX)
        .collect()
        .await
        .map_err(|_| StatusCode::PAYLOAD_TOO_LARGE)?
        .to_bytes();
    Ok(Form(form_urlencoded::parse(&body).into_owned().collect()))
}

async fn answer(console: &Console, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/healthz") => return respond(StatusCode::OK, "text/plain", "ok\n"),
        (&Method::GET, "/assets/console.css") => {
            return respond(StatusCode::OK, "text/css", pages::CSS);
        }
        (&Method::GET, "/assets/console.js") => {
            return respond(StatusCode::OK, "text/javascript", pages::JS);
        }
        (&Method::GET, "/login") => return html(StatusCode::OK, pages::login(console, None)),
        (&Method::POST, "/login") => return login(console, req).await,
        _ => {}
    }
    if !authorized(console, &req) {
        return html(
            StatusCode::UNAUTHORIZED,
            pages::login(console, Some("This console needs its token.")),
        );
    }
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    if method == Method::GET {
        return match parts.as_slice() {
            [""] => {
                let mut histories = Vec::with_capacity(console.queues.len());
                for queue in &console.queues {
                    histories.push(queue.history(console.prometheus.as_deref()).await);
                }
                html(StatusCode::OK, pages::overview(console, &histories))
            }
            ["q", i] => with_queue(console, i, |queue| letters(console, queue, &req)).await,
            ["q", i, "l", id] => {
                let id = percent(id);
                with_queue(console, i, |queue| letter(console, queue, id)).await
            }
            ["q", i, "purge"] => {
                with_queue(console, i, |queue| purge_page(console, queue, &req)).await
            }
            ["q", i, "jobs"] => with_queue(console, i, |queue| jobs_page(console, queue)).await,
            ["q", i, "jobs.json"] => with_queue(console, i, jobs_json).await,
            _ => problem(console, StatusCode::NOT_FOUND, "No such page."),
        };
    }
    if method != Method::POST {
        return problem(
            console,
            StatusCode::METHOD_NOT_ALLOWED,
            "Only GET and POST.",
        );
    }
    if !same_origin(&req) {
        return problem(
            console,
            StatusCode::FORBIDDEN,
            "Refused: this request came from another site. Changes are made from the console's own pages.",
        );
    }
    if !console.allow_writes {
        return problem(
            console,
            StatusCode::FORBIDDEN,
            "This console is read-only: start it with --allow-writes to replay, edit, purge or cancel.",
        );
    }
    let parts: Vec<String> = parts.iter().map(|p| percent(p)).collect();
    let form = match form(req).await {
        Ok(form) => form,
        Err(status) => return problem(console, status, "The request is too large."),
    };
    if !form
        .one("form_token")
        .is_some_and(|t| same(t, &console.form_token))
    {
        return problem(
            console,
            StatusCode::FORBIDDEN,
            "Refused: the form's token is missing or stale. Reload the page and try again.",
        );
    }
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    match parts.as_slice() {
        ["q", i, "replay"] => with_queue(console, i, |queue| replay(console, queue, &form)).await,
        ["q", i, "purge"] => with_queue(console, i, |queue| purge(console, queue, &form)).await,
        ["q", i, "l", id, "edit"] => {
            with_queue(console, i, |queue| edit_letter(console, queue, id, &form)).await
        }
        ["q", i, "jobs", id, "cancel"] => {
            with_queue(console, i, |queue| cancel(console, queue, id, &form)).await
        }
        _ => problem(console, StatusCode::NOT_FOUND, "No such action."),
    }
}

fn percent(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

async fn with_queue<'a, F, Fut>(console: &'a Console, index: &str, then: F) -> Response<Full<Bytes>>
where
    F: FnOnce(&'a Queue) -> Fut,
    Fut: Future<Output = Response<Full<Bytes>>>,
{
    match index
        .parse::<usize>()
        .ok()
        .and_then(|i| console.queues.get(i))
    {
        Some(queue) => then(queue).await,
        None => problem(console, StatusCode::NOT_FOUND, "No such queue."),
    }
}

async fn login(console: &Console, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let Some(token) = &console.token else {
        return see_other("/");
    };
    if !same_origin(&req) {
        return problem(
            console,
            StatusCode::FORBIDDEN,
            "Refused: a login from another site.",
        );
    }
    let form = match form(req).await {
        Ok(form) => form,
        Err(status) => return problem(console, status, "The request is too large."),
    };
    if form.one("token").is_some_and(|t| same(t.trim(), token)) {
        let mut response = see_other("/");
        if let Ok(cookie) = header::HeaderValue::from_str(&format!(
            "{SESSION_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
            session_of(token)
        )) {
            response.headers_mut().insert(header::SET_COOKIE, cookie);
        }
        return response;
    }
    html(
        StatusCode::UNAUTHORIZED,
        pages::login(console, Some("That is not the token.")),
    )
}

/// The filter of a page's query: the expression, parsed.
fn filter_of(text: Option<&str>) -> Result<Filter, String> {
    let expression = text
        .filter(|t| !t.trim().is_empty())
        .map(Expr::parse)
        .transpose()
        .map_err(|e| e.to_string())?;
    Ok(Filter {
        expression,
        ..Filter::default()
    })
}

async fn letters(
    console: &Console,
    queue: &Queue,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let query = query(req);
    let text = query.get("filter").map(String::as_str).unwrap_or_default();
    let filter = match filter_of(Some(text)) {
        Ok(filter) => filter,
        Err(e) => {
            return html(
                StatusCode::BAD_REQUEST,
                pages::letters(console, queue, &Page::refused(text, e)),
            );
        }
    };
    let after = query.get("after").cloned();
    let read = async {
        let store = queue.store().await?;
        let mut page = Page::new(text, after.clone());
        Walk::new(&store, &queue.spec.dlq, &filter, &[])?
            .after(after)
            .each(None, PAGE + 1, false, async |letter| {
                page.letters.push(letter);
                Ok(())
            })
            .await?;
        if page.letters.len() > PAGE {
            page.letters.truncate(PAGE);
            page.next = page.letters.last().map(|l| l.id.clone());
        }
        let mut counted = 0;
        Walk::new(&store, &queue.spec.dlq, &filter, &[])?
            .each(None, COUNT_AT_MOST, false, async |letter| {
                counted += 1;
                page.count(&letter);
                Ok(())
            })
            .await?;
        page.counted = counted;
        page.counted_all = counted < COUNT_AT_MOST;
        anyhow::Ok(page)
    };
    match read.await {
        Ok(page) => html(StatusCode::OK, pages::letters(console, queue, &page)),
        Err(e) => problem(
            console,
            StatusCode::BAD_GATEWAY,
            &format!("Cannot read {}: {e:#}", queue.spec.dlq),
        ),
    }
}

async fn letter(console: &Console, queue: &Queue, id: String) -> Response<Full<Bytes>> {
    let found = async {
        let store = queue.store().await?;
        select(
            &store,
            &queue.spec.dlq,
            &Filter::default(),
            std::slice::from_ref(&id),
        )
        .await
    };
    match found.await {
        Ok((letters, _)) => match letters.first() {
            Some(letter) => html(StatusCode::OK, pages::letter(console, queue, letter, None)),
            None => problem(
                console,
                StatusCode::NOT_FOUND,
                &format!(
                    "No dead letter {id} in {}: replayed or purged already?",
                    queue.spec.dlq
                ),
            ),
        },
        Err(e) => problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

async fn purge_page(
    console: &Console,
    queue: &Queue,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let query = query(req);
    let text = query.get("filter").map(String::as_str).unwrap_or_default();
    let filter = match filter_of(Some(text)) {
        Ok(filter) => filter,
        Err(e) => return problem(console, StatusCode::BAD_REQUEST, &e),
    };
    let counted = async {
        let store = queue.store().await?;
        let walked = Walk::new(&store, &queue.spec.dlq, &filter, &[])?
            .each(None, usize::MAX, false, async |_| Ok(()))
            .await?;
        anyhow::Ok(walked.selected)
    };
    match counted.await {
        Ok(count) => html(StatusCode::OK, pages::purge(console, queue, text, count)),
        Err(e) => problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

async fn jobs_page(console: &Console, queue: &Queue) -> Response<Full<Bytes>> {
    match listed_jobs(queue).await {
        Ok(jobs) => html(StatusCode::OK, pages::jobs(console, queue, &jobs)),
        Err(e) => problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

async fn jobs_json(queue: &Queue) -> Response<Full<Bytes>> {
    match listed_jobs(queue).await {
        Ok(jobs) => respond(
            StatusCode::OK,
            "application/json",
            serde_json::Value::from(jobs).to_string(),
        ),
        Err(e) => respond(
            StatusCode::BAD_GATEWAY,
            "application/json",
            serde_json::json!({"error": format!("{e:#}")}).to_string(),
        ),
    }
}

async fn listed_jobs(queue: &Queue) -> anyhow::Result<Vec<serde_json::Value>> {
    let store = queue.store().await?;
    jobs::listed(&store, &queue.spec.dlq).await
}

/// Starts a replay or purge job in the background, as `courier dlq`
/// would run it, and sends the browser to the jobs page, which follows it.
async fn start(
    console: &Console,
    queue: &Queue,
    kind: Kind,
    filter: Filter,
    selection: Selection,
    rate: Option<f64>,
    why: Option<String>,
) -> Response<Full<Bytes>> {
    let store = match queue.store().await {
        Ok(store) => store,
        Err(e) => return problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    };
    let target = queue.target();
    let (dlq, into) = (queue.spec.dlq.clone(), queue.spec.queue.clone());
    // A thread of its own: a job runs for as long as its letters take, and
    // its walk's future is not one tokio can move between threads.
    std::thread::spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => return eprintln!("console: the job did not run: {e}"),
        };
        runtime.block_on(async move {
            let bulk = Bulk {
                kind,
                target: &target,
                source: store,
                dlq,
                into,
                filter,
                selection,
                rate,
                why,
            };
            if let Err(e) = jobs::start(bulk, &mut std::io::sink()).await {
                eprintln!("console: the job did not run: {e:#}");
            }
        });
    });
    let index = console.index_of(queue);
    see_other(&format!("/q/{index}/jobs"))
}

fn rate_of(form: &Form) -> Result<Option<f64>, String> {
    form.one("rate")
        .map(crate::cmd::dlq::parse_rate)
        .transpose()
}

async fn replay(console: &Console, queue: &Queue, form: &Form) -> Response<Full<Bytes>> {
    let rate = match rate_of(form) {
        Ok(rate) => rate,
        Err(e) => return problem(console, StatusCode::BAD_REQUEST, &format!("rate: {e}")),
    };
    let ids = form.all("id");
    let by_filter = form.one("all").is_some();
    let filter = match filter_of(form.one("filter").filter(|_| by_filter)) {
        Ok(filter) => filter,
        Err(e) => return problem(console, StatusCode::BAD_REQUEST, &e),
    };
    if ids.is_empty() && !by_filter {
        return problem(
            console,
            StatusCode::BAD_REQUEST,
            "Nothing selected: tick letters, or replay every letter the filter matches.",
        );
    }
    let selection = Selection {
        all: ids.is_empty(),
        ids,
    };
    let why = form.one("why").map(str::to_string);
    start(console, queue, Kind::Replay, filter, selection, rate, why).await
}

async fn purge(console: &Console, queue: &Queue, form: &Form) -> Response<Full<Bytes>> {
    if form.one("confirm") != Some(queue.spec.queue.as_str()) {
        return problem(
            console,
            StatusCode::BAD_REQUEST,
            &format!(
                "Not purged: type the queue's name, {}, to confirm.",
                queue.spec.queue
            ),
        );
    }
    let Some(why) = form.one("why") else {
        return problem(
            console,
            StatusCode::BAD_REQUEST,
            "Not purged: say why (the audit trail records it); a purge cannot be undone.",
        );
    };
    let filter = match filter_of(form.one("filter")) {
        Ok(filter) => filter,
        Err(e) => return problem(console, StatusCode::BAD_REQUEST, &e),
    };
    let selection = Selection {
        ids: Vec::new(),
        all: true,
    };
    start(
        console,
        queue,
        Kind::Purge,
        filter,
        selection,
        None,
        Some(why.to_string()),
    )
    .await
}

async fn edit_letter(
    console: &Console,
    queue: &Queue,
    id: &str,
    form: &Form,
) -> Response<Full<Bytes>> {
    let Some(text) = form.one("patch") else {
        return problem(console, StatusCode::BAD_REQUEST, "No patch given.");
    };
    let patch = match edit::parse_patch(text) {
        Ok(patch) => patch,
        Err(e) => {
            return problem(
                console,
                StatusCode::BAD_REQUEST,
                &format!("The patch is {e}"),
            );
        }
    };
    let dry_run = form.one("preview").is_some();
    let mut out = Vec::new();
    let done = edit::apply_and_replay(
        &queue.target(),
        id,
        patch,
        &format!("{id} --patch (console)"),
        dry_run,
        form.one("why"),
        &mut out,
    )
    .await;
    let out = String::from_utf8_lossy(&out).into_owned();
    match done {
        Ok(code) if code == std::process::ExitCode::SUCCESS => html(
            StatusCode::OK,
            pages::edited(console, queue, id, dry_run, &out),
        ),
        Ok(_) => problem(
            console,
            StatusCode::UNPROCESSABLE_ENTITY,
            &format!(
                "Dead letter {id} was not edited; it stays as it was (the patch does not apply to it, or it is gone)."
            ),
        ),
        Err(e) => problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    }
}

async fn cancel(console: &Console, queue: &Queue, id: &str, form: &Form) -> Response<Full<Bytes>> {
    let store = match queue.store().await {
        Ok(store) => store,
        Err(e) => return problem(console, StatusCode::BAD_GATEWAY, &format!("{e:#}")),
    };
    let auditor = Auditor::connect(&queue.target()).await;
    match jobs::ask_cancel(&store, &queue.spec.dlq, id, &auditor, form.one("why")).await {
        Ok(_) => {
            let index = console.index_of(queue);
            see_other(&format!("/q/{index}/jobs"))
        }
        Err(e) => problem(console, StatusCode::CONFLICT, &format!("{e:#}")),
    }
}
