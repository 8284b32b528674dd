//! The server side of the SASL mechanisms the front offers: the accounts
//! given on the command line and one login's exchange of auth bytes.

use std::num::NonZeroU32;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use courier::source::sasl::Mechanism;
use ring::{digest, hmac, pbkdf2};

/// What Kafka's brokers use by default; librdkafka takes up to 1,000,000.
const SCRAM_ITERATIONS: NonZeroU32 = NonZeroU32::new(4096).unwrap();

/// A mechanism by its exact name, as a broker matches a client's: the
/// same names courier logs in with.
fn mechanism_named(name: &str) -> Option<Mechanism> {
    Mechanism::parse(name).ok().filter(|m| m.name() == name)
}

/// One `--sasl` argument: a user and password for PLAIN or SCRAM, or the
/// exact bearer token OAUTHBEARER accepts (then `user` is empty).
pub struct Account {
    mechanism: Mechanism,
    user: String,
    secret: String,
}

impl Account {
    /// Parses `MECHANISM:user:password` or `OAUTHBEARER:token`. The error
    /// names the mechanism only, never the secret.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let Some((name, rest)) = spec.split_once(':') else {
            // Without a colon the argument may be a bare password or token.
            return Err("--sasl takes MECHANISM:CREDENTIALS".into());
        };
        let Some(mechanism) = mechanism_named(name) else {
            return Err(format!(
                "--sasl: {name:?} is not PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER"
            ));
        };
        let (user, secret) = match mechanism {
            Mechanism::OAuthBearer => ("", rest),
            // A password may hold colons; a user cannot.
            _ => rest.split_once(':').unwrap_or(("", "")),
        };
        if secret.is_empty() || (mechanism != Mechanism::OAuthBearer && user.is_empty()) {
            return Err(match mechanism {
                Mechanism::OAuthBearer => "--sasl OAUTHBEARER takes OAUTHBEARER:token".into(),
                _ => format!("--sasl {name} takes {name}:user:password"),
            });
        }
        Ok(Account {
            mechanism,
            user: user.to_owned(),
            secret: secret.to_owned(),
        })
    }
}

pub struct Accounts(Vec<Account>);

impl Accounts {
    pub fn new(accounts: Vec<Account>) -> Self {
        Accounts(accounts)
    }

    /// The mechanisms named on the command line, in their first order.
    pub fn mechanisms(&self) -> Vec<Mechanism> {
        let mut offered = Vec::new();
        for account in &self.0 {
            if !offered.contains(&account.mechanism) {
                offered.push(account.mechanism);
            }
        }
        offered
    }

    pub fn offers(&self, name: &str) -> Option<Mechanism> {
        mechanism_named(name).filter(|m| self.0.iter().any(|a| a.mechanism == *m))
    }

    fn find(&self, mechanism: Mechanism, user: &str) -> Option<&Account> {
        self.0
            .iter()
            .find(|a| a.mechanism == mechanism && a.user == user)
    }
}

/// What a login answers one SaslAuthenticate request with.
pub enum Step {
    /// Auth bytes for the client, which is to send more.
    Continue(Vec<u8>),
    /// The client is in; its last auth bytes.
    Accepted(Vec<u8>),
    Refused,
}

/// One connection's login, after its SaslHandshake chose the mechanism.
pub struct Login {
    mechanism: Mechanism,
    scram: Option<ScramServerFirst>,
}

/// What SCRAM's last step checks the client's proof against.
struct ScramServerFirst {
    user: String,
    salted_password: Vec<u8>,
    gs2_header: String,
    nonce: String,
    /// client-first-message-bare "," server-first-message
    auth_message_head: String,
}

impl Login {
    pub fn new(mechanism: Mechanism) -> Self {
        Login {
            mechanism,
            scram: None,
        }
    }

    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    pub fn step(&mut self, accounts: &Accounts, auth: &[u8]) -> Step {
        let (who, step) = match self.mechanism {
            Mechanism::Plain => plain(accounts, auth),
            Mechanism::OAuthBearer => ("bearer".to_owned(), oauthbearer(accounts, auth)),
            Mechanism::ScramSha256 | Mechanism::ScramSha512 => match self.scram.take() {
                None => match self.scram_first(accounts, auth) {
                    Ok((first, reply)) => {
                        self.scram = Some(first);
                        return Step::Continue(reply);
                    }
                    Err(user) => (user, Step::Refused),
                },
                Some(first) => (first.user.clone(), self.scram_final(&first, auth)),
            },
        };
        let outcome = match step {
            Step::Refused => "refused",
            _ => "accepted",
        };
        let who = match who.as_str() {
            "" => "an unnamed user".to_owned(),
            who => who.escape_debug().to_string(),
        };
        eprintln!(
            "kafka-mock: SASL {} login of {who} {outcome}",
            self.mechanism.name()
        );
        step
    }

    /// Answers client-first-message (`n,,n=user,r=cnonce`) with
    /// server-first-message; the error is the user to log.
    fn scram_first(
        &self,
        accounts: &Accounts,
        auth: &[u8],
    ) -> Result<(ScramServerFirst, Vec<u8>), String> {
        let message = std::str::from_utf8(auth).map_err(|_| String::new())?;
        // gs2-header: a channel-binding flag ("p=..." asks for binding,
        // which a front without it cannot give), an optional authzid.
        let mut parts = message.splitn(3, ',');
        let (Some(flag @ ("n" | "y")), Some(authzid), Some(bare)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(String::new());
        };
        let (mut user, mut cnonce) = (None, None);
        for attribute in bare.split(',') {
            match attribute.split_at_checked(2) {
                Some(("n=", name)) => user = Some(name.replace("=2C", ",").replace("=3D", "=")),
                Some(("r=", nonce)) => cnonce = Some(nonce),
                // A mandatory extension this server does not know.
                Some(("m=", _)) => return Err(user.unwrap_or_default()),
                _ => {}
            }
        }
        let (Some(user), Some(cnonce)) = (user, cnonce) else {
            return Err(String::new());
        };
        let Some(account) = accounts.find(self.mechanism, &user) else {
            return Err(user);
        };
        let hash = Hash::of(self.mechanism);
        let salt: [u8; 16] = rand::random();
        let mut salted_password = vec![0; hash.len()];
        pbkdf2::derive(
            hash.pbkdf2(),
            SCRAM_ITERATIONS,
            &salt,
            account.secret.as_bytes(),
            &mut salted_password,
        );
        let nonce = format!("{cnonce}{}", BASE64.encode(rand::random::<[u8; 18]>()));
        let server_first = format!("r={nonce},s={},i={SCRAM_ITERATIONS}", BASE64.encode(salt));
        let first = ScramServerFirst {
            user,
            salted_password,
            gs2_header: format!("{flag},{authzid},"),
            nonce,
            auth_message_head: format!("{bare},{server_first}"),
        };
        Ok((first, server_first.into_bytes()))
    }

    /// Checks client-final-message (`c=biws,r=nonce,p=proof`) and answers
    /// server-final-message (`v=signature`).
    fn scram_final(&self, first: &ScramServerFirst, auth: &[u8]) -> Step {
        let Some(message) = std::str::from_utf8(auth).ok() else {
            return Step::Refused;
        };
        let Some((without_proof, proof)) = message.rsplit_once(",p=") else {
            return Step::Refused;
        };
        let mut binding = None;
        let mut nonce = None;
        for attribute in without_proof.split(',') {
            match attribute.split_at_checked(2) {
                Some(("c=", value)) => binding = Some(value),
                Some(("r=", value)) => nonce = Some(value),
                _ => {}
            }
        }
        if binding != Some(BASE64.encode(&first.gs2_header).as_str())
            || nonce != Some(first.nonce.as_str())
        {
            return Step::Refused;
        }
        let Ok(proof) = BASE64.decode(proof) else {
            return Step::Refused;
        };
        let hash = Hash::of(self.mechanism);
        let auth_message = format!("{},{without_proof}", first.auth_message_head);
        let client_key = hash.hmac(&first.salted_password, b"Client Key");
        let stored_key = hash.digest(&client_key);
        let signature = hash.hmac(&stored_key, auth_message.as_bytes());
        if proof.len() != signature.len() {
            return Step::Refused;
        }
        let recovered: Vec<u8> = proof.iter().zip(&signature).map(|(p, s)| p ^ s).collect();
        if hash.digest(&recovered) != stored_key {
            return Step::Refused;
        }
        let server_key = hash.hmac(&first.salted_password, b"Server Key");
        let verifier = hash.hmac(&server_key, auth_message.as_bytes());
        Step::Accepted(format!("v={}", BASE64.encode(verifier)).into_bytes())
    }
}

/// `authzid NUL user NUL password`; the user to log, and the outcome.
fn plain(accounts: &Accounts, auth: &[u8]) -> (String, Step) {
    let mut parts = auth.splitn(3, |b| *b == 0);
    let (Some(authzid), Some(user), Some(password)) = (parts.next(), parts.next(), parts.next())
    else {
        return (String::new(), Step::Refused);
    };
    let user = String::from_utf8_lossy(user).into_owned();
    // Kafka, too, refuses to let one user act as another.
    let as_itself = authzid.is_empty() || authzid == user.as_bytes();
    let step = match accounts.find(Mechanism::Plain, &user) {
        Some(account) if as_itself && account.secret.as_bytes() == password => {
            Step::Accepted(Vec::new())
        }
        _ => Step::Refused,
    };
    (user, step)
}

/// RFC 7628's client response, `n,,^Aauth=Bearer <token>^A[key=value^A]*^A`.
fn oauthbearer(accounts: &Accounts, auth: &[u8]) -> Step {
    let Ok(message) = std::str::from_utf8(auth) else {
        return Step::Refused;
    };
    let mut fields = message.split('\x01');
    if !fields
        .next()
        .is_some_and(|gs2| gs2.starts_with("n,") || gs2.starts_with("y,"))
    {
        return Step::Refused;
    }
    let token = fields
        .take_while(|kv| !kv.is_empty())
        .filter_map(|kv| kv.strip_prefix("auth="))
        .find_map(|value| {
            let (scheme, token) = value.split_once(' ')?;
            scheme.eq_ignore_ascii_case("Bearer").then_some(token)
        });
    match token {
        Some(token)
            if accounts
                .0
                .iter()
                .any(|a| a.mechanism == Mechanism::OAuthBearer && a.secret == token) =>
        {
            Step::Accepted(Vec::new())
        }
        _ => Step::Refused,
    }
}

#[derive(Clone, Copy)]
enum Hash {
    Sha256,
    Sha512,
}

impl Hash {
    fn of(mechanism: Mechanism) -> Self {
        match mechanism {
            Mechanism::ScramSha512 => Hash::Sha512,
            _ => Hash::Sha256,
        }
    }

    fn len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }

    fn pbkdf2(self) -> pbkdf2::Algorithm {
        match self {
            Hash::Sha256 => pbkdf2::PBKDF2_HMAC_SHA256,
            Hash::Sha512 => pbkdf2::PBKDF2_HMAC_SHA512,
        }
    }

    fn hmac(self, key: &[u8], message: &[u8]) -> Vec<u8> {
        let algorithm = match self {
            Hash::Sha256 => hmac::HMAC_SHA256,
            Hash::Sha512 => hmac::HMAC_SHA512,
        };
        hmac::sign(&hmac::Key::new(algorithm, key), message)
            .as_ref()
            .to_vec()
    }

    fn digest(self, message: &[u8]) -> Vec<u8> {
        let algorithm = match self {
            Hash::Sha256 => &digest::SHA256,
            Hash::Sha512 => &digest::SHA512,
        };
        digest::digest(algorithm, message).as_ref().to_vec()
    }
}
