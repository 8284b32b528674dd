//! The last hour of a queue's dead-letter depth from Prometheus, for the
//! overview's sparkline: the sidecars export `courier_dlq_depth{queue}`, so
//! a console started minutes ago still shows the hour.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// How long a query may take before the overview shows the console's own
/// samples instead.
const WAIT: Duration = Duration::from_secs(3);
/// The answer read at most: 120 points are a few kilobytes.
const ANSWER_MAX: usize = 1 << 20;

/// `max(courier_dlq_depth{queue=Q})` over the last hour at 30 s steps.
pub(super) async fn dead_letters_last_hour(
    base: &str,
    queue: &str,
) -> Result<Vec<(SystemTime, u64)>, String> {
    // To the millisecond: the last step is evaluated at now, and a series
    // only seconds old has no sample before a whole second cut off.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let escaped = queue.replace('\\', "\\\\").replace('"', "\\\"");
    let query: String = form_urlencoded::Serializer::new(String::new())
        .append_pair(
            "query",
            &format!("max(courier_dlq_depth{{queue=\"{escaped}\"}})"),
        )
        .append_pair("start", &format!("{:.3}", now - 3600.0))
        .append_pair("end", &format!("{now:.3}"))
        .append_pair("step", "30")
        .finish();
    let uri: http::Uri = format!("{}/api/v1/query_range?{query}", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// (Prometheus inside the cluster) is read".into());
    }
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let answer = tokio::time::timeout(WAIT, client.get(uri))
        .await
        .map_err(|_| format!("no answer within {WAIT:?}"))?
        .map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        return Err(format!("it answered {}", answer.status()));
    }
    let body = http_body_util::Limited::new(answer.into_body(), ANSWER_MAX)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    points(&body)
}

/// The points of a `query_range` answer's first series.
fn points(body: &[u8]) -> Result<Vec<(SystemTime, u64)>, String> {
    let json: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let Some(values) = json["data"]["result"][0]["values"].as_array() else {
        return Err("no series: is a sidecar of this queue scraped?".into());
    };
    Ok(values
        .iter()
        .filter_map(|point| {
            let at = point[0].as_f64()?;
            let value = point[1].as_str()?.parse::<f64>().ok()?;
            Some((
                UNIX_EPOCH + Duration::from_secs_f64(at.max(0.0)),
                value.max(0.0) as u64,
            ))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_answer_reads_as_points() {
        let body = br#"{"status":"success","data":{"resultType":"matrix","result":[{"metric":{},"values":[[1800000000,"3"],[1800000030,"5"]]}]}}"#;
        let got = points(body).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], (UNIX_EPOCH + Duration::from_secs(1_800_000_030), 5));
        assert!(
            points(br#"{"data":{"result":[]}}"#)
                .unwrap_err()
                .contains("no series")
        );
    }
}
