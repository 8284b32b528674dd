//! Hiding credentials in `--source` URLs, for logs and errors.
//!
//! A URL reaches courier in many shapes, some of them wrong: with or
//! without `//`, with a raw `@` or `/` in the password, with a password
//! where a port should be. Whatever could be a credential is hidden, in
//! every shape: a log line with too little in it is the lesser harm.

use std::fmt;

/// The URL with everything that could be a credential hidden:
/// `amqp://guest:guest@h/v` becomes `amqp://***@h/v`.
///
/// - The whole user info goes, up to the last `@`, the user name too: a
///   token (`nats://token@host`) sits where a user name does. The cut is at
///   the last `@`, because a password may hold a raw `@` or `/` that a URL
///   parser would read differently; an `@` after the host (rare in a broker
///   URL) then hides the host as well.
/// - The scheme is kept only when it is a broker's (`amqp:`) or followed by
///   `//`: in `user:pw@host` the "scheme" is a user name.
/// - Without an `@`, a host followed by something other than a port number
///   (`amqp://user:pw/v`, `amqp:user:pw`) may be user and password with the
///   `@host` forgotten: that part goes.
/// - Query parameters that name a credential (`?password=`, `?token=`) keep
///   their name and lose their value.
pub fn redact(url: &str) -> String {
    Redacted::of(url).shown
}

/// A parser's error about `url`, unless it quotes something [`redact`]
/// hides: then only that the URL could not be read. Parsers quote the part
/// they choke on, and in a malformed URL that part may be the password.
pub fn redact_error(url: &str, error: impl fmt::Display) -> String {
    let error = error.to_string();
    let hidden = Redacted::of(url).hidden;
    let leaks = hidden.iter().any(|secret| {
        error.contains(secret.as_str()) || error.contains(percent_decode(secret).as_str())
    });
    if leaks {
        "it is not a URL courier can read (the parser's message is left out because it quotes a credential)".into()
    } else {
        error
    }
}

/// What [`redact`] hides of `url`, each part as written and percent-decoded:
/// the texts a log line must never show, whoever writes it
/// (`courier::telemetry::hide_in_logs`).
///
/// A user name followed by a password is not one of them: it is shown
/// wherever it is written (RabbitMQ's "refused the login of user") and,
/// hidden everywhere, would cut words like `guest` out of every line.
pub fn secrets_of(url: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    let redacted = Redacted::of(url);
    for secret in redacted.hidden {
        if redacted.user.as_deref() == Some(secret.as_str()) {
            continue;
        }
        let decoded = percent_decode(&secret);
        if decoded != secret {
            secrets.push(decoded);
        }
        secrets.push(secret);
    }
    secrets
}

/// Query parameter names that hold a credential, as parts of the name.
const SECRET_PARAMETERS: &[&str] = &["pass", "pwd", "token", "secret", "key", "cred"];

struct Redacted {
    shown: String,
    /// What was hidden, whole and in parts, never empty.
    hidden: Vec<String>,
    /// The user name of `user:password@`, when there is a password that
    /// does not contain it (`guest:guest` hides `guest`).
    user: Option<String>,
}

impl Redacted {
    fn of(url: &str) -> Self {
        let mut hidden = Vec::new();
        let mut user = None;
        let (scheme, rest) = split_scheme(url);
        let slashes = rest.len() - rest.trim_start_matches(['/', '\\']).len();
        let (slashes, rest) = rest.split_at(slashes);
        let (user_info, location) = match rest.rsplit_once('@') {
            Some((user_info, location)) => {
                hide(&mut hidden, user_info);
                user = user_info
                    .split_once(':')
                    .filter(|(name, password)| !password.is_empty() && !password.contains(name))
                    .map(|(name, _)| name.to_string());
                ("***@", location)
            }
            None => ("", rest),
        };
        let end = location.find(['/', '?', '#']).unwrap_or(location.len());
        let (authority, path) = location.split_at(end);
        let authority = if user_info.is_empty() && !is_host_and_port(authority) {
            hide(&mut hidden, authority);
            "***"
        } else {
            authority
        };
        let path = hide_secret_parameters(path, &mut hidden);
        Self {
            shown: format!("{scheme}{slashes}{user_info}{authority}{path}"),
            hidden,
            user,
        }
    }
}

/// The URL schemes of every broker courier has, whether or not this build
/// has it: a scheme known here is split off even without a `//` after it
/// (`embedded:/dir`). `courier::source` checks that its table's schemes are
/// all here.
pub const KNOWN_SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
    "amqp",
    "amqps",
    "nats",
    "tls",
    "embedded",
    "kafka",
    "kafkas",
    "sqs",
    "pubsub",
];

/// `amqp:` and the rest, when the text starts with a scheme: one of
/// [`KNOWN_SCHEMES`], or any followed by `//`; else `""` and the text.
pub fn split_scheme(url: &str) -> (&str, &str) {
    let Some((scheme, rest)) = url.split_once(':') else {
        return ("", url);
    };
    let known = KNOWN_SCHEMES.contains(&scheme);
    let well_formed = scheme
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    if known || (well_formed && rest.starts_with("//")) {
        url.split_at(scheme.len() + 1)
    } else {
        ("", url)
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`, `h1:p1,h2:p2`; not a
/// password in the place of a port.
fn is_host_and_port(authority: &str) -> bool {
    authority.split(',').all(|one| {
        let port = match one.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((_, after)) => match after.strip_prefix(':') {
                    Some(port) => Some(port),
                    None => return after.is_empty(),
                },
                None => return false,
            },
            None => one.split_once(':').map(|(_, port)| port),
        };
        port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The path and query with the values of credential parameters hidden.
fn hide_secret_parameters(path: &str, hidden: &mut Vec<String>) -> String {
    let Some((before, query)) = path.split_once('?') else {
        return path.to_string();
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let parameters: Vec<String> = query
        .split('&')
        .map(|parameter| match parameter.split_once('=') {
            Some((name, value))
                if !value.is_empty()
                    && SECRET_PARAMETERS
                        .iter()
                        .any(|s| name.to_ascii_lowercase().contains(s)) =>
            {
                hide(hidden, value);
                format!("{name}=***")
            }
            _ => parameter.to_string(),
        })
        .collect();
    let mut out = format!("{before}?{}", parameters.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// Notes `secret` as hidden: whole, and each part a `:` separates.
fn hide(hidden: &mut Vec<String>, secret: &str) {
    for part in std::iter::once(secret).chain(secret.split(':')) {
        if !part.is_empty() {
            hidden.push(part.to_string());
        }
    }
}

/// `%40` → `@`: URL user info is percent-encoded (NATS takes it decoded;
/// an error may quote it decoded).
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_credentials_are_percent_decoded() {
        assert_eq!(percent_decode("p%40ss%2Fword"), "p@ss/word");
        assert_eq!(percent_decode("plain%"), "plain%");
    }

    #[test]
    fn a_user_name_is_not_hidden_in_logs_but_its_password_and_a_token_are() {
        let secrets = secrets_of("amqp://guest:wrong-password@h/v");
        assert!(
            secrets.contains(&"wrong-password".to_string()),
            "{secrets:?}"
        );
        assert!(!secrets.contains(&"guest".to_string()), "{secrets:?}");
        let same = secrets_of("amqp://guest:guest@h/v");
        assert!(same.contains(&"guest".to_string()), "{same:?}");
        let token = secrets_of("nats://s3cr3t-token@h");
        assert!(token.contains(&"s3cr3t-token".to_string()), "{token:?}");
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact("redis://:pw@host:6379"), "redis://***@host:6379");
        assert_eq!(redact("amqp://guest:guest@h/v"), "amqp://***@h/v");
        assert_eq!(redact("nats://s3cr3t-token@h:4222"), "nats://***@h:4222");
        assert_eq!(redact("redis://host:6379/0"), "redis://host:6379/0");
        assert_eq!(redact("redis://[::1]:6379/0"), "redis://[::1]:6379/0");
        assert_eq!(
            redact("nats://a:4222,b:4222"),
            "nats://a:4222,b:4222",
            "a server list"
        );
        assert_eq!(redact("embedded:/var/lib/q"), "embedded:/var/lib/q");
        assert_eq!(redact("embedded:relative/q"), "embedded:relative/q");
    }

    #[test]
    fn no_part_of_a_password_with_raw_at_or_slash_leaks() {
        for (url, shown) in [
            ("redis://:p@ss@host:6379", "redis://***@host:6379"),
            ("amqp://u:a@b@c@h:5672/v", "amqp://***@h:5672/v"),
            ("redis://u:p/ss?x#y@host/0", "redis://***@host/0"),
            ("u:p@ss@host:6379", "***@host:6379"),
        ] {
            let redacted = redact(url);
            assert_eq!(redacted, shown, "{url}");
            for secret in ["p@ss", "ss@", "a@b", "b@c", "p/ss", "u:"] {
                assert!(!redacted.contains(secret), "{secret} in {redacted}");
            }
        }
    }

    /// The odd shapes a URL is mistyped in, for every scheme: none of them
    /// shows the password (`pw`, `hunter2`).
    #[test]
    fn every_shape_of_every_scheme_hides_the_password() {
        for scheme in KNOWN_SCHEMES {
            for (form, shown) in [
                ("{s}://user:hunter2@host:1/v", "{s}://***@host:1/v"),
                ("{s}:user:hunter2@host", "{s}:***@host"),
                ("{s}:/user:hunter2@host", "{s}:/***@host"),
                ("{s}:///user:hunter2@host", "{s}:///***@host"),
                ("{s}:\\\\user:hunter2@host", "{s}:\\\\***@host"),
                ("{s}://user:hun@ter2@host", "{s}://***@host"),
                ("{s}://user:hunter2", "{s}://***"),
                ("{s}:user:hunter2", "{s}:***"),
                ("{s}://user:hunter2/vhost", "{s}://***/vhost"),
                ("{s}://user:hunter2%40host/v", "{s}://***/v"),
                (
                    "{s}://host:1/?password=hunter2",
                    "{s}://host:1/?password=***",
                ),
                (
                    "{s}://host/?a=1&auth_token=hunter2#f",
                    "{s}://host/?a=1&auth_token=***#f",
                ),
                ("{s}://hunter2@host", "{s}://***@host"),
            ] {
                let url = form.replace("{s}", scheme);
                let redacted = redact(&url);
                assert_eq!(redacted, shown.replace("{s}", scheme), "{url}");
                for secret in ["hunter2", "hun", "ter2", "user"] {
                    assert!(!redacted.contains(secret), "{secret} in {redacted}");
                }
            }
        }
    }

    #[test]
    fn a_user_name_in_the_place_of_a_scheme_is_hidden() {
        assert_eq!(redact("token@host:4222"), "***@host:4222");
        assert_eq!(redact("user:hunter2@host"), "***@host");
        // mqtt is no broker of courier's: its name reads as a user name.
        assert_eq!(redact("mqtt:user:hunter2@host"), "***@host");
        // A broker's own scheme, missing its slashes, stays readable.
        assert_eq!(redact("kafka:user:hunter2@host"), "kafka:***@host");
        assert_eq!(redact("kafka://u:hunter2@host"), "kafka://***@host");
    }

    #[test]
    fn a_parser_error_that_quotes_a_credential_is_left_out() {
        let url = "amqp://user:hunter2/vhost";
        let err = redact_error(url, "invalid port number \"hunter2\"");
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("credential"), "{err}");
        let url = "amqp://user:p%40ss@host";
        let err = redact_error(url, "bad password p@ss");
        assert!(!err.contains("p@ss"), "{err}");
        assert_eq!(
            redact_error("amqp://host:x1/", "invalid port number"),
            "invalid port number"
        );
    }
}
