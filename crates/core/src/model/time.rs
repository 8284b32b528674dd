//! Times as courier stores them: RFC 3339 in UTC with milliseconds.

use std::time::SystemTime;

/// Reads an RFC 3339 time as courier writes it.
pub fn parse_time(value: &[u8]) -> Option<SystemTime> {
    httpdate_rfc3339::parse(std::str::from_utf8(value).ok()?)
}

/// RFC 3339 in UTC with milliseconds, e.g. `2026-11-29T19:51:26.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    httpdate_rfc3339::format(t)
}

/// Small, dependency-free RFC 3339 (UTC) formatting and parsing; civil-date
/// arithmetic after Howard Hinnant's algorithms.
mod httpdate_rfc3339 {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    pub fn format(t: SystemTime) -> String {
        let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs() as i64;
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let (y, m, d) = civil_from_days(days);
        if !(0..=9999).contains(&y) {
            return format!(
                "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
                rem / 3600,
                rem / 60 % 60,
                rem % 60,
                since.subsec_millis()
            );
        }
        // Digit by digit into a fixed buffer: `format!` cost some 3,000
        // instructions a call, and the Redis reader stamps every read.
        let mut out = *b"0000-00-00T00:00:00.000Z";
        let mut put = |at: usize, width: usize, mut value: u64| {
            for i in (at..at + width).rev() {
                out[i] = b'0' + (value % 10) as u8;
                value /= 10;
            }
        };
        put(0, 4, y as u64);
        put(5, 2, m as u64);
        put(8, 2, d as u64);
        put(11, 2, (rem / 3600) as u64);
        put(14, 2, (rem / 60 % 60) as u64);
        put(17, 2, (rem % 60) as u64);
        put(20, 3, u64::from(since.subsec_millis()));
        String::from_utf8(out.to_vec()).expect("digits and ASCII punctuation")
    }

    pub fn parse(s: &str) -> Option<SystemTime> {
        let s = s.trim();
        let b = s.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b't') {
            return None;
        }
        let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        let mut rest = &s[19..];
        let mut nanos = 0u32;
        if let Some(frac) = rest.strip_prefix('.') {
            let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
            let text = &frac[..digits.min(9)];
            nanos = format!("{text:0<9}").parse().ok()?;
            rest = &frac[digits..];
        }
        let offset = match rest {
            "Z" | "z" => 0,
            _ => {
                let sign = match rest.as_bytes().first()? {
                    b'+' => 1,
                    b'-' => -1,
                    _ => return None,
                };
                let oh: i64 = rest.get(1..3)?.parse().ok()?;
                let om: i64 = rest.get(4..6)?.parse().ok()?;
                sign * (oh * 3600 + om * 60)
            }
        };
        let days = days_from_civil(y, mo, d);
        let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset;
        let secs = u64::try_from(secs).ok()?;
        Some(UNIX_EPOCH + Duration::new(secs, nanos))
    }

    fn civil_from_days(z: i64) -> (i64, i64, i64) {
        let z = z + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        (yoe + era * 400 + i64::from(m <= 2), m, d)
    }

    fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let mp = (m + 9) % 12;
        let doy = (153 * mp + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_241_086_123);
        let text = rfc3339(t);
        assert_eq!(text, "2026-12-02T19:51:26.123Z");
        assert_eq!(httpdate_rfc3339::parse(&text), Some(t));
        assert_eq!(
            httpdate_rfc3339::parse("2026-12-02T20:51:26.123+01:00"),
            Some(t)
        );
        assert_eq!(httpdate_rfc3339::parse("yesterday"), None);
    }

    #[test]
    fn rfc3339_pads_every_part() {
        let cases = [
            (0, "1970-01-01T00:00:00.000Z"),
            (951_782_400_007, "2000-02-29T00:00:00.007Z"),
            (253_402_300_799_999, "9999-12-31T23:59:59.999Z"),
            (253_402_300_800_000, "10000-01-01T00:00:00.000Z"),
        ];
        for (millis, text) in cases {
            let t = SystemTime::UNIX_EPOCH + Duration::from_millis(millis);
            assert_eq!(rfc3339(t), text);
        }
    }
}
