//! A SASL login (Kafka's `--kafka-sasl-*` flags): the mechanism, the user
//! and the secret, read from the environment or a mounted Secret's file,
//! never from the URL, and never shown by `Debug`.

use std::fmt;

/// The SASL mechanisms courier logs in with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Plain,
    ScramSha256,
    ScramSha512,
    /// OAuth 2 client credentials: the user is the client id, the secret
    /// the client secret, exchanged at the token URL for a bearer token.
    OAuthBearer,
}

impl Mechanism {
    /// The names the flag takes, as Kafka and librdkafka spell them.
    pub const NAMES: [&'static str; 4] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"];

    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => Self::NAMES[0],
            Self::ScramSha256 => Self::NAMES[1],
            Self::ScramSha512 => Self::NAMES[2],
            Self::OAuthBearer => Self::NAMES[3],
        }
    }

    /// Reads a mechanism's name, in any case; the error lists the known.
    pub fn parse(text: &str) -> Result<Self, String> {
        let upper = text.trim().to_ascii_uppercase();
        [
            Self::Plain,
            Self::ScramSha256,
            Self::ScramSha512,
            Self::OAuthBearer,
        ]
        .into_iter()
        .find(|m| m.name() == upper)
        .ok_or_else(|| {
            format!(
                "{text:?} is not a SASL mechanism courier speaks; use one of {}",
                Self::NAMES.join(", ")
            )
        })
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A SASL login: who, with what secret, by which mechanism.
#[derive(Clone, PartialEq, Eq)]
pub struct Sasl {
    pub mechanism: Mechanism,
    /// The user name; with OAUTHBEARER, the OAuth client id.
    pub username: String,
    /// The password; with OAUTHBEARER, the OAuth client secret.
    secret: String,
    /// With OAUTHBEARER: where the client credentials are exchanged.
    pub token_url: Option<String>,
    /// With OAUTHBEARER: the scope asked for, when the provider wants one.
    pub scope: Option<String>,
    /// Where the secret came from (the flag or variable), for messages.
    pub secret_from: String,
}

impl Sasl {
    pub fn new(
        mechanism: Mechanism,
        username: String,
        secret: String,
        secret_from: String,
    ) -> Self {
        Self {
            mechanism,
            username,
            secret,
            token_url: None,
            scope: None,
            secret_from,
        }
    }

    /// The password or client secret, for the client library only.
    pub fn secret(&self) -> &str {
        &self.secret
    }
}

impl fmt::Debug for Sasl {
    // The secret never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .field("token_url", &self.token_url)
            .field("scope", &self.scope)
            .field("secret_from", &self.secret_from)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_in_any_case() {
        for name in Mechanism::NAMES {
            assert_eq!(Mechanism::parse(name).unwrap().name(), name);
            assert_eq!(Mechanism::parse(&name.to_lowercase()).unwrap().name(), name);
        }
        let err = Mechanism::parse("GSSAPI").unwrap_err();
        assert!(
            err.contains("GSSAPI") && err.contains("SCRAM-SHA-512"),
            "{err}"
        );
    }

    #[test]
    fn debug_leaves_the_secret_out() {
        let sasl = Sasl::new(
            Mechanism::Plain,
            "alice".into(),
            "hunter2".into(),
            "COURIER_KAFKA_SASL_PASSWORD".into(),
        );
        let shown = format!("{sasl:?}");
        assert!(
            shown.contains("alice") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
