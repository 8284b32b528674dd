//! Durations in the Kubernetes/Go form (`500ms`, `1m30s`, `1.5h`), the form
//! every duration in a RetryPolicy and on the command line uses.

use std::time::Duration;

/// Why a duration string was refused; the text is shown to the user as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a duration; write it like 500ms, 30s, 1m30s or 2h")]
pub struct ParseDurationError(pub String);

/// Parses `"1m30s"`, `"500ms"`, `"1.5s"`, `"0"`. Units: ns, us, µs, ms, s, m, h.
pub fn parse(text: &str) -> Result<Duration, ParseDurationError> {
    let err = || ParseDurationError(text.to_string());
    let s = text.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(err());
    }
    let mut total_nanos: f64 = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        if number_len == 0 {
            return Err(err());
        }
        let value: f64 = rest[..number_len].parse().map_err(|_| err())?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let nanos_per_unit = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total_nanos += value * nanos_per_unit;
    }
    if !total_nanos.is_finite() || total_nanos > u64::MAX as f64 {
        return Err(err());
    }
    Ok(Duration::from_nanos(total_nanos.round() as u64))
}

/// Formats a duration the way [`parse`] reads it, shortest exact form first.
pub fn format(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if !nanos.is_multiple_of(1_000_000_000) {
        return if nanos.is_multiple_of(1_000_000) {
            format!("{}ms", nanos / 1_000_000)
        } else {
            format!("{nanos}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 {
        out.push_str(&format!("{s}s"));
    }
    out
}

/// clap value parser for duration flags.
pub fn parse_flag(text: &str) -> Result<Duration, String> {
    parse(text).map_err(|e| e.to_string())
}

/// A broker's limit as courier keeps to it: `limit`, or the duration in
/// the environment variable `name`, from one second to `most`. It is an
/// operations and testing knob, not a flag: a test sets SQS's 12 h
/// visibility or Pub/Sub's 600 s ack deadline to a few seconds, and courier
/// then does past it what it does past the real one (chains copies),
/// without the test waiting that long. The error says what was wrong; the
/// source does not open then.
pub fn limit_from_env(name: &str, limit: Duration, most: Duration) -> Result<Duration, String> {
    limit_from(name, std::env::var(name).ok().as_deref(), limit, most)
}

/// [`limit_from_env`] of the variable's value `text`, when it is set.
fn limit_from(
    name: &str,
    text: Option<&str>,
    limit: Duration,
    most: Duration,
) -> Result<Duration, String> {
    let Some(text) = text else {
        return Ok(limit);
    };
    let refused = |why: &str| {
        format!(
            "{name}={text:?} {why}; give a duration from 1s to {} (unset, it is {})",
            format(most),
            format(limit)
        )
    };
    match parse(text) {
        Ok(value) if (Duration::from_secs(1)..=most).contains(&value) => Ok(value),
        Ok(_) => Err(refused("is out of bounds")),
        Err(_) => Err(refused("is not a duration")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        let rows = [
            ("0", Duration::ZERO),
            ("500ms", Duration::from_millis(500)),
            ("30s", Duration::from_secs(30)),
            ("1m30s", Duration::from_secs(90)),
            ("1.5s", Duration::from_millis(1500)),
            ("2h", Duration::from_secs(7200)),
            ("1h1m1s", Duration::from_secs(3661)),
            ("250us", Duration::from_micros(250)),
            ("10ns", Duration::from_nanos(10)),
        ];
        for (text, want) in rows {
            assert_eq!(parse(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn refuses_what_is_not_a_duration() {
        for text in ["", "5", "s", "1x", "1.2.3s", "-1s", "1m x", "ms5"] {
            assert!(parse(text).is_err(), "{text:?} should be refused");
        }
    }

    #[test]
    fn format_round_trips() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(250),
            Duration::from_secs(90),
            Duration::from_secs(3600),
            Duration::from_secs(3725),
        ] {
            assert_eq!(parse(&format(d)), Ok(d));
        }
    }

    #[test]
    fn a_limit_is_lowered_only_within_bounds() {
        let (limit, most) = (Duration::from_secs(600), Duration::from_secs(600));
        let of = |text| limit_from("COURIER_X", text, limit, most);
        assert_eq!(of(None).unwrap(), limit);
        assert_eq!(of(Some("2s")).unwrap(), Duration::from_secs(2));
        assert_eq!(of(Some("10m")).unwrap(), most);
        for bad in ["0", "500ms", "11m", "soon", ""] {
            let e = of(Some(bad)).unwrap_err();
            assert!(e.starts_with("COURIER_X="), "{e}");
        }
    }
}
