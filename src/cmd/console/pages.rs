//! The console's pages, rendered on the server: plain HTML with one style
//! sheet and one small script, both inside the binary. Everything from a
//! dead letter or a broker is escaped ([`esc`]): a letter's body is the
//! producer's text, not the console's.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{Duration, SystemTime};

use http::StatusCode;

use super::{Console, History, Queue};
use crate::cmd::dlq::filter::age;
use crate::duration;
use crate::model::DeadLetter;

pub(super) const CSS: &str = include_str!("assets/console.css");
pub(super) const JS: &str = include_str!("assets/console.js");

/// `text` safe inside HTML text and attribute values.
pub(super) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one component of a URL's path or query.
fn url(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn layout(console: &Console, title: &str, body: &str) -> String {
    let mode = if console.allow_writes {
        "writes allowed"
    } else {
        "read-only"
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · courier console</title>\
         <link rel=\"stylesheet\" href=\"/assets/console.css\">\
         <script src=\"/assets/console.js\" defer></script></head>\
         <body><header><a href=\"/\" class=\"brand\">courier console</a>\
         <span class=\"mode\" id=\"mode\">{mode}</span></header><main>{body}</main></body></html>\n",
        esc(title)
    )
}

fn form_token(console: &Console) -> String {
    format!(
        "<input type=\"hidden\" name=\"form_token\" value=\"{}\">",
        esc(&console.form_token)
    )
}

pub(super) fn problem(console: &Console, status: StatusCode, text: &str) -> String {
    layout(
        console,
        status.canonical_reason().unwrap_or("Error"),
        &format!(
            "<h1>{}</h1><p class=\"problem\" id=\"problem\">{}</p><p><a href=\"/\">Overview</a></p>",
            status.as_u16(),
            esc(text)
        ),
    )
}

pub(super) fn login(console: &Console, note: Option<&str>) -> String {
    let note = note.map_or(String::new(), |n| {
        format!("<p class=\"problem\" id=\"problem\">{}</p>", esc(n))
    });
    layout(
        console,
        "Log in",
        &format!(
            "<h1>Log in</h1>{note}<form method=\"post\" action=\"/login\" id=\"login\">\
             <label>Token <input type=\"password\" name=\"token\" id=\"token\" autocomplete=\"off\"></label>\
             <button type=\"submit\">Log in</button></form>"
        ),
    )
}

fn short_age(age: Option<Duration>) -> String {
    age.map_or("—".into(), |a| {
        duration::format(Duration::from_secs(a.as_secs()))
    })
}

fn figure(value: Option<u64>) -> String {
    value.map_or("—".into(), |v| v.to_string())
}

/// The dead-letter depth over the samples, as a line of 120 × 24; its
/// `data-source` says whose samples they are.
fn sparkline(history: &History) -> String {
    let points = &history.points;
    let from = history.from;
    if points.is_empty() {
        return format!(
            "<svg class=\"spark\" width=\"120\" height=\"24\" role=\"img\" aria-label=\"no samples yet\" data-source=\"{from}\" data-points=\"0\"></svg>"
        );
    }
    let max = points.iter().map(|(_, v)| *v).max().unwrap_or(0).max(1) as f64;
    // One sample is a flat line across, not a dot.
    let step = 120.0 / (points.len().max(2) - 1) as f64;
    let mut line: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, (_, v))| {
            format!(
                "{:.1},{:.1}",
                i as f64 * step,
                23.0 - *v as f64 / max * 22.0
            )
        })
        .collect();
    if points.len() == 1 {
        line.push(format!(
            "120.0,{:.1}",
            23.0 - points[0].1 as f64 / max * 22.0
        ));
    }
    let last = points.last().map(|(_, v)| *v).unwrap_or_default();
    format!(
        "<svg class=\"spark\" width=\"120\" height=\"24\" role=\"img\" aria-label=\"dead letters over the last {} samples, now {last}\" data-source=\"{from}\" data-points=\"{}\"><polyline fill=\"none\" stroke=\"currentColor\" stroke-width=\"1.5\" points=\"{}\"/></svg>",
        points.len(),
        points.len(),
        line.join(" ")
    )
}

pub(super) fn overview(console: &Console, histories: &[History]) -> String {
    let mut rows = String::new();
    for (i, queue) in console.queues.iter().enumerate() {
        let spec = &queue.spec;
        let (depth, note) = match queue.last() {
            None => (None, "not read yet".to_string()),
            Some((_, Ok(Some(depth)))) => (Some(depth), String::new()),
            Some((_, Ok(None))) => (
                None,
                "this broker's depth is read by the sidecars (courier_queue_depth)".into(),
            ),
            Some((_, Err(e))) => (None, e),
        };
        let cell =
            |class: &str, value: String| format!("<td class=\"{class} num\">{}</td>", esc(&value));
        let _ = write!(
            rows,
            "<tr data-queue=\"{}\"><td><a href=\"/q/{i}\">{}</a><div class=\"note\">{}</div></td><td>{}</td>{}{}{}{}{}<td class=\"spark-cell\">{}</td><td><a href=\"/q/{i}/jobs\">jobs</a></td></tr>",
            esc(&spec.queue),
            esc(&spec.name),
            esc(&note),
            esc(spec.url.broker().name),
            cell("ready", figure(depth.as_ref().and_then(|d| d.ready))),
            cell("in-flight", figure(depth.as_ref().map(|d| d.pending))),
            cell(
                "retry-backlog",
                figure(depth.as_ref().map(|d| d.retry_backlog))
            ),
            cell(
                "dead-letters",
                figure(depth.as_ref().map(|d| d.dead_letters))
            ),
            cell(
                "oldest",
                short_age(depth.as_ref().and_then(|d| d.oldest_dead_letter_age))
            ),
            histories.get(i).map_or_else(String::new, sparkline),
        );
    }
    layout(
        console,
        "Overview",
        &format!(
            "<h1>Queues</h1><table id=\"queues\"><thead><tr><th>Queue</th><th>Broker</th>\
             <th>Ready</th><th>In flight</th><th>Retry backlog</th><th>Dead letters</th>\
             <th>Oldest dead letter</th><th>Dead letters, last hour</th><th></th></tr></thead>\
             <tbody>{rows}</tbody></table>"
        ),
    )
}

/// A page of dead letters, and the counts of the letters the filter
/// selects.
pub(super) struct Page {
    pub filter: String,
    pub after: Option<String>,
    pub letters: Vec<DeadLetter>,
    pub next: Option<String>,
    pub refused: Option<String>,
    pub by_reason: BTreeMap<String, usize>,
    pub by_status: BTreeMap<String, usize>,
    pub counted: usize,
    /// Whether the counts are of every selected letter, not the first
    /// ones only.
    pub counted_all: bool,
}

impl Page {
    pub fn new(filter: &str, after: Option<String>) -> Self {
        Self {
            filter: filter.to_string(),
            after,
            letters: Vec::new(),
            next: None,
            refused: None,
            by_reason: BTreeMap::new(),
            by_status: BTreeMap::new(),
            counted: 0,
            counted_all: true,
        }
    }

    pub fn refused(filter: &str, why: String) -> Self {
        Self {
            refused: Some(why),
            ..Self::new(filter, None)
        }
    }

    pub fn count(&mut self, letter: &DeadLetter) {
        let reason = letter.field("courier-reason").unwrap_or("?").to_string();
        let status = letter
            .field("courier-status")
            .filter(|s| !s.is_empty())
            .unwrap_or("none")
            .to_string();
        *self.by_reason.entry(reason).or_default() += 1;
        *self.by_status.entry(status).or_default() += 1;
    }
}

fn counts(id: &str, title: &str, counts: &BTreeMap<String, usize>) -> String {
    let items: String = counts
        .iter()
        .map(|(k, n)| {
            format!(
                "<li data-key=\"{}\"><span>{}</span> <b>{n}</b></li>",
                esc(k),
                esc(k)
            )
        })
        .collect();
    format!("<div class=\"counts\" id=\"{id}\"><h3>{title}</h3><ul>{items}</ul></div>")
}

pub(super) fn letters(console: &Console, queue: &Queue, page: &Page) -> String {
    let i = console.index_of(queue);
    let now = SystemTime::now();
    let refused = page.refused.as_ref().map_or(String::new(), |e| {
        format!(
            "<p class=\"problem\" id=\"problem\">The filter is refused: {}</p>",
            esc(e)
        )
    });
    let counted = if page.counted_all {
        format!("{} dead letters selected", page.counted)
    } else {
        format!("counted over the first {} selected", page.counted)
    };
    let mut rows = String::new();
    for letter in &page.letters {
        let select = if console.allow_writes {
            format!(
                "<td><input type=\"checkbox\" name=\"id\" value=\"{}\" form=\"replay-selected\"></td>",
                esc(&letter.id)
            )
        } else {
            String::new()
        };
        let excerpt: String = letter
            .field("courier-response-excerpt")
            .unwrap_or_default()
            .chars()
            .take(80)
            .collect();
        let _ = write!(
            rows,
            "<tr data-id=\"{}\">{select}<td><a href=\"/q/{i}/l/{}\">{}</a></td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"excerpt\">{}</td></tr>",
            esc(&letter.id),
            url(&letter.id),
            esc(&letter.id),
            esc(&short_age(age(letter, now))),
            esc(letter.field("courier-reason").unwrap_or("?")),
            esc(letter
                .field("courier-status")
                .filter(|s| !s.is_empty())
                .unwrap_or("—")),
            esc(letter.field("courier-attempts").unwrap_or("?")),
            esc(&excerpt),
        );
    }
    let next = page.next.as_ref().map_or(String::new(), |after| {
        format!(
            "<a id=\"next\" href=\"/q/{i}?filter={}&amp;after={}\">Next page</a>",
            url(&page.filter),
            url(after)
        )
    });
    let first = page.after.as_ref().map_or(String::new(), |_| {
        format!(
            "<a id=\"first\" href=\"/q/{i}?filter={}\">First page</a> ",
            url(&page.filter)
        )
    });
    let actions = if console.allow_writes {
        format!(
            "<section class=\"actions\"><form method=\"post\" action=\"/q/{i}/replay\" id=\"replay-selected\">{token}\
             <label>Rate <input name=\"rate\" placeholder=\"50/s\" size=\"6\"></label> \
             <label>Why <input name=\"why\" size=\"16\"></label> \
             <button type=\"submit\" id=\"replay-selected-button\">Replay selected</button></form>\
             <form method=\"post\" action=\"/q/{i}/replay\" id=\"replay-filter\">{token}\
             <input type=\"hidden\" name=\"all\" value=\"1\"><input type=\"hidden\" name=\"filter\" value=\"{f}\">\
             <label>Rate <input name=\"rate\" id=\"replay-rate\" placeholder=\"50/s\" size=\"6\"></label> \
             <label>Why <input name=\"why\" size=\"16\"></label> \
             <button type=\"submit\" id=\"replay-filter-button\">Replay all {what}</button></form>\
             <a class=\"danger\" id=\"purge-link\" href=\"/q/{i}/purge?filter={fu}\">Purge all {what}…</a></section>",
            token = form_token(console),
            f = esc(&page.filter),
            fu = url(&page.filter),
            what = if page.filter.trim().is_empty() {
                "dead letters"
            } else {
                "that match"
            },
        )
    } else {
        String::new()
    };
    let select_head = if console.allow_writes {
        "<th></th>"
    } else {
        ""
    };
    layout(
        console,
        &format!("{} dead letters", queue.spec.name),
        &format!(
            "<h1>{name} <small>{dlq}</small></h1><nav><a href=\"/\">Overview</a> · <a href=\"/q/{i}/jobs\">Jobs</a></nav>\
             <form method=\"get\" action=\"/q/{i}\" id=\"filter-form\">\
             <input name=\"filter\" id=\"filter\" size=\"60\" value=\"{f}\" placeholder='status >= 500 &amp;&amp; headers[\"x-tenant\"] == \"acme\"'>\
             <button type=\"submit\">Filter</button></form>{refused}\
             <section class=\"summary\"><p id=\"counted\">{counted}</p>{reasons}{statuses}</section>{actions}\
             <table id=\"letters\"><thead><tr>{select_head}<th>ID</th><th>Age</th><th>Reason</th><th>Status</th><th>Attempts</th><th>Response</th></tr></thead>\
             <tbody>{rows}</tbody></table><p class=\"pager\">{first}{next}</p>",
            name = esc(&queue.spec.name),
            dlq = esc(&queue.spec.dlq),
            f = esc(&page.filter),
            reasons = counts("by-reason", "By reason", &page.by_reason),
            statuses = counts("by-status", "By status", &page.by_status),
        ),
    )
}

/// A body as the letter view shows it: JSON pretty-printed, text as text,
/// anything else as a hex dump.
fn body_view(body: &[u8]) -> (&'static str, String) {
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(body)
        && (json.is_object() || json.is_array())
    {
        return (
            "json",
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        );
    }
    if let Ok(text) = std::str::from_utf8(body) {
        return ("text", text.to_string());
    }
    let mut hex = String::new();
    for (row, chunk) in body.chunks(16).enumerate() {
        let _ = write!(hex, "{:08x}  ", row * 16);
        for b in chunk {
            let _ = write!(hex, "{b:02x} ");
        }
        hex.push_str(&"   ".repeat(16 - chunk.len()));
        hex.push(' ');
        hex.extend(chunk.iter().map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        }));
        hex.push('\n');
    }
    ("hex", hex)
}

pub(super) fn letter(
    console: &Console,
    queue: &Queue,
    letter: &DeadLetter,
    note: Option<&str>,
) -> String {
    let i = console.index_of(queue);
    let courier = |name: &str| name.to_ascii_lowercase().starts_with("courier-");
    let rows = |mine: bool| -> String {
        letter
            .fields
            .iter()
            .filter(|(n, _)| courier(n) == mine)
            .map(|(n, v)| format!("<tr><th>{}</th><td>{}</td></tr>", esc(n), esc(v)))
            .collect()
    };
    let (kind, body) = body_view(&letter.body);
    let note = note.map_or(String::new(), |n| {
        format!("<p class=\"note\">{}</p>", esc(n))
    });
    let actions = if console.allow_writes {
        format!(
            "<section class=\"actions\"><form method=\"post\" action=\"/q/{i}/replay\" id=\"replay-one\">{token}\
             <input type=\"hidden\" name=\"id\" value=\"{id}\"><button type=\"submit\">Replay this letter</button></form>\
             <form method=\"post\" action=\"/q/{i}/l/{idu}/edit\" id=\"edit\">{token}\
             <label>JSON Patch (RFC 6902) on {{\"headers\": {{…}}, \"body\": …}}<br>\
             <textarea name=\"patch\" id=\"patch\" rows=\"5\" cols=\"70\">[]</textarea></label><br>\
             <label>Why <input name=\"why\" size=\"24\"></label> \
             <button type=\"submit\" name=\"preview\" value=\"1\" id=\"edit-preview\">Preview</button> \
             <button type=\"submit\" id=\"edit-replay\">Edit and replay</button></form></section>",
            token = form_token(console),
            id = esc(&letter.id),
            idu = url(&letter.id),
        )
    } else {
        String::new()
    };
    layout(
        console,
        &format!("Dead letter {}", letter.id),
        &format!(
            "<h1>Dead letter <code id=\"letter-id\">{id}</code></h1><nav><a href=\"/\">Overview</a> · <a href=\"/q/{i}\">{name}</a></nav>{note}\
             <div class=\"attempts\"><p>First attempt <time id=\"first-attempt\">{first}</time>, last <time id=\"last-attempt\">{last}</time>; \
             reason <b id=\"reason\">{reason}</b>, status <b id=\"status\">{status}</b>, {attempts} attempts</p></div>\
             <h2>Response</h2><pre id=\"excerpt\">{excerpt}</pre>\
             <h2>Headers</h2><table id=\"headers\">{headers}</table>\
             <h2>Body <small>({kind}, {len} bytes)</small></h2><pre id=\"body\" class=\"body-{kind}\">{body}</pre>\
             <h2>Record</h2><table id=\"record\">{record}</table>{actions}",
            id = esc(&letter.id),
            name = esc(&queue.spec.name),
            first = esc(letter.field("courier-first-attempt-at").unwrap_or("—")),
            last = esc(letter.field("courier-last-attempt-at").unwrap_or("—")),
            reason = esc(letter.field("courier-reason").unwrap_or("?")),
            status = esc(letter
                .field("courier-status")
                .filter(|s| !s.is_empty())
                .unwrap_or("—")),
            attempts = esc(letter.field("courier-attempts").unwrap_or("?")),
            excerpt = esc(letter.field("courier-response-excerpt").unwrap_or_default()),
            headers = rows(false),
            record = rows(true),
            len = letter.body.len(),
            body = esc(&body),
        ),
    )
}

pub(super) fn edited(
    console: &Console,
    queue: &Queue,
    id: &str,
    preview: bool,
    out: &str,
) -> String {
    let i = console.index_of(queue);
    let title = if preview {
        "Preview of the edit"
    } else {
        "Edited and replayed"
    };
    layout(
        console,
        title,
        &format!(
            "<h1 id=\"edited\">{title}</h1><p>Dead letter <code>{}</code> of {}.</p><pre id=\"edit-output\">{}</pre>\
             <p><a href=\"/q/{i}\">Back to the dead letters</a> · <a href=\"/q/{i}/l/{}\">The letter</a></p>",
            esc(id),
            esc(&queue.spec.dlq),
            esc(out),
            url(id),
        ),
    )
}

pub(super) fn purge(console: &Console, queue: &Queue, filter: &str, count: usize) -> String {
    let i = console.index_of(queue);
    let what = if filter.trim().is_empty() {
        "every dead letter".to_string()
    } else {
        format!("the dead letters that match <code>{}</code>", esc(filter))
    };
    let form = if console.allow_writes {
        format!(
            "<form method=\"post\" action=\"/q/{i}/purge\" id=\"purge\">{}\
             <input type=\"hidden\" name=\"filter\" value=\"{}\">\
             <label>Type the queue's name, <code>{q}</code>, to confirm <input name=\"confirm\" id=\"confirm\" autocomplete=\"off\"></label><br>\
             <label>Why (the audit trail records it) <input name=\"why\" id=\"purge-why\" size=\"30\"></label><br>\
             <button type=\"submit\" class=\"danger\" id=\"purge-button\">Delete {count} dead letters</button></form>",
            form_token(console),
            esc(filter),
            q = esc(&queue.spec.queue),
        )
    } else {
        "<p>This console is read-only.</p>".to_string()
    };
    layout(
        console,
        "Purge",
        &format!(
            "<h1>Purge {}</h1><p id=\"purge-count\" data-count=\"{count}\">This deletes {what}: <b>{count}</b> now. \
             Letters that arrive later are not touched. There is no undo.</p>{form}\
             <p><a href=\"/q/{i}\">Back</a></p>",
            esc(&queue.spec.dlq),
        ),
    )
}

pub(super) fn jobs(console: &Console, queue: &Queue, jobs: &[serde_json::Value]) -> String {
    let i = console.index_of(queue);
    let mut rows = String::new();
    for job in jobs.iter().rev() {
        let text = |name: &str| job[name].as_str().unwrap_or_default().to_string();
        let number = |name: &str| job[name].as_u64().unwrap_or_default();
        let id = text("id");
        let state = text("state");
        let cancel = if console.allow_writes && (state == "running" || state == "interrupted") {
            format!(
                "<form method=\"post\" action=\"/q/{i}/jobs/{}/cancel\" class=\"cancel\">{}<button type=\"submit\">Cancel</button></form>",
                url(&id),
                form_token(console)
            )
        } else {
            String::new()
        };
        let (done, total) = (number("done"), number("total"));
        let _ = write!(
            rows,
            "<tr data-job=\"{}\" data-state=\"{}\"><td><code>{}</code></td><td>{}</td><td class=\"state\">{}</td>\
             <td><progress max=\"{total}\" value=\"{done}\"></progress> <span class=\"done\">{done}/{total}</span></td>\
             <td class=\"rate\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{cancel}</td></tr>",
            esc(&id),
            esc(&state),
            esc(&id),
            esc(&text("kind")),
            esc(&state),
            job["rate"]
                .as_f64()
                .map_or("—".into(), |r| format!("≤ {r}/s")),
            esc(&text("started_at")),
            esc(&text("by")),
            esc(job["why"].as_str().unwrap_or("—")),
        );
    }
    if jobs.is_empty() {
        rows.push_str("<tr class=\"empty\"><td colspan=\"9\">No jobs yet.</td></tr>");
    }
    layout(
        console,
        &format!("{} jobs", queue.spec.name),
        &format!(
            "<h1>Jobs <small>{}</small></h1><nav><a href=\"/\">Overview</a> · <a href=\"/q/{i}\">Dead letters</a></nav>\
             <table id=\"jobs\" data-source=\"/q/{i}/jobs.json\"><thead><tr><th>ID</th><th>Kind</th><th>State</th><th>Done</th>\
             <th>Rate</th><th>Started</th><th>By</th><th>Why</th><th></th></tr></thead><tbody>{rows}</tbody></table>",
            esc(&queue.spec.dlq),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_letter_holds_is_escaped() {
        assert_eq!(
            esc("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
    }

    #[test]
    fn a_body_shows_as_json_text_or_hex() {
        assert_eq!(
            body_view(br#"{"a":1}"#),
            ("json", "{\n  \"a\": 1\n}".to_string())
        );
        assert_eq!(body_view(b"plain"), ("text", "plain".to_string()));
        let (kind, hex) = body_view(&[0xff, 0x00, b'A']);
        assert_eq!(kind, "hex");
        assert!(hex.starts_with("00000000  ff 00 41 "), "{hex}");
        assert!(hex.trim_end().ends_with("..A"), "{hex}");
    }

    #[test]
    fn a_sparkline_spans_its_samples() {
        let t = SystemTime::UNIX_EPOCH;
        let history = |points: Vec<(SystemTime, u64)>| History {
            points,
            from: "console",
        };
        let svg = sparkline(&history(vec![(t, 0), (t, 5), (t, 10)]));
        assert!(
            svg.contains("points=\"0.0,23.0 60.0,12.0 120.0,1.0\""),
            "{svg}"
        );
        assert!(
            svg.contains("now 10") && svg.contains("data-source=\"console\""),
            "{svg}"
        );
        let one = sparkline(&history(vec![(t, 4)]));
        assert!(one.contains("points=\"0.0,1.0 120.0,1.0\""), "{one}");
    }

    #[test]
    fn a_page_counts_by_reason_and_status() {
        let mut page = Page::new("", None);
        let letter = |reason: &str, status: &str| DeadLetter {
            id: "1-0".into(),
            body: Default::default(),
            fields: vec![
                ("courier-reason".into(), reason.into()),
                ("courier-status".into(), status.into()),
            ],
        };
        page.count(&letter("permanent-status", "400"));
        page.count(&letter("permanent-status", "422"));
        page.count(&letter("attempts-exhausted", ""));
        assert_eq!(page.by_reason["permanent-status"], 2);
        assert_eq!(page.by_status["none"], 1);
    }
}
