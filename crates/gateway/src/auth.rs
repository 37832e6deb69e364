//! Access control: bearer tokens with roles, checked on every RPC by one tower layer before any
//! service code runs. Tokens are compared by SHA-256 digest in constant time and never logged.
//! The role × RPC matrix is [`allowed`]; runtime tokens are further scoped to agent ids, which
//! each handler checks against the agent its request names ([`Principal::require_agent`]); and
//! the few rules that depend on what a request carries, which the layer cannot see, are
//! [`allowed_action`], checked by the handler that decodes the request ([`Principal::require`]).
//! Every access rule lives in this file; handlers only ask.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::Status;

use crate::config::TokenConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Connector services: append observations, confirm posts.
    Connector,
    /// The agent runtime, for the agents its token names.
    Runtime,
    /// Replay tools.
    Replay,
    /// Analytics consumers: content-free views only.
    Analytics,
    /// Everything.
    Admin,
}

/// Who is calling, attached to the request by the auth layer.
#[derive(Clone, Debug)]
pub struct Principal {
    pub role: Role,
    /// For runtime tokens: the agents it may act for.
    pub agents: Arc<BTreeSet<String>>,
    pub name: Arc<str>,
}

/// Something a request may carry that needs more than access to its RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// An agent registration through `Ingest.Append`/`AppendStream`: it changes configuration
    /// that drives decisions (identities, hence routing and send holds), like the `[[agents]]`
    /// the server appends at start-up, so only an admin may append one.
    RegisterAgent,
}

/// The role × action matrix, beside the role × RPC matrix [`allowed`].
pub fn allowed_action(role: Role, action: Action) -> bool {
    match (role, action) {
        (Role::Admin, _) => true,
        (Role::Connector | Role::Runtime | Role::Replay | Role::Analytics, Action::RegisterAgent) => false,
    }
}

impl Principal {
    /// Refuses an action this principal's role may not take ([`allowed_action`]).
    pub fn require(&self, action: Action) -> Result<(), Status> {
        if allowed_action(self.role, action) {
            return Ok(());
        }
        tracing::info!(token = %self.name, ?action, "permission denied");
        Err(Status::permission_denied(match action {
            Action::RegisterAgent => "registering agents needs an admin token",
        }))
    }

    /// Refuses acting for an agent the token is not scoped to.
    /// Only runtime tokens are scoped; which RPCs a role reaches at all is [`allowed`]'s to say
    /// (so replay tools, which may read any agent's memory-pass status, pass here).
    pub fn require_agent(&self, agent: &str) -> Result<(), Status> {
        match self.role {
            Role::Admin | Role::Connector | Role::Replay => Ok(()),
            Role::Runtime if self.agents.contains(agent) => Ok(()),
            _ => Err(Status::permission_denied(format!(
                "this token may not act for agent {}",
                anima_engine::validate::echo(agent)
            ))),
        }
    }

    /// The principal of a request that passed the auth layer.
    pub fn of<T>(request: &tonic::Request<T>) -> Result<Principal, Status> {
        request
            .extensions()
            .get::<Principal>()
            .cloned()
            .ok_or_else(|| Status::unauthenticated("no principal on the request"))
    }
}

/// The role × RPC matrix. `path` is the gRPC path `/package.Service/Method`.
#[allow(clippy::match_like_matches_macro)] // Reads as the matrix it is.
pub fn allowed(role: Role, path: &str) -> bool {
    let Some((service, _method)) = path.trim_start_matches('/').split_once('/') else {
        return false;
    };
    match (role, service, path) {
        (Role::Admin, _, _) => true,
        (_, "grpc.health.v1.Health", _) => true,
        (_, "grpc.reflection.v1.ServerReflection" | "grpc.reflection.v1alpha.ServerReflection", _) => true,
        (Role::Connector, "anima.v1.Ingest", _) => true,
        (Role::Connector, _, "/anima.v1.Sends/Confirm") => true,
        (Role::Runtime, "anima.v1.Wakes" | "anima.v1.Sends" | "anima.v1.Subscriptions", _) => true,
        // A runtime sees the memory-pass status of its own agents; the fleet-wide plan is for
        // operators (replay, admin). Outcomes carry error prose: no analytics.
        (Role::Runtime, _, "/anima.v1.Memory/Status") => true,
        (Role::Replay, "anima.v1.Memory", _) => true,
        // Replay reads content (stored events): replay and admin only. Analytics is content-free,
        // so the replay role, trusted with more, may call it too.
        (Role::Replay, "anima.v1.Replay" | "anima.v1.Analytics", _) => true,
        (Role::Analytics, "anima.v1.Analytics", _) => true,
        _ => false,
    }
}

struct TokenEntry {
    digest: [u8; 32],
    principal: Principal,
}

/// The configured tokens. With none configured every caller is an admin (the server then
/// refuses to listen on anything but loopback).
#[derive(Clone)]
pub struct Auth {
    tokens: Arc<Vec<TokenEntry>>,
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    pub fn new(configs: &[TokenConfig]) -> anyhow::Result<Auth> {
        let mut tokens = Vec::new();
        for (index, config) in configs.iter().enumerate() {
            let digest: [u8; 32] = match (&config.token, &config.token_sha256) {
                (Some(token), _) => Sha256::digest(token.as_bytes()).into(),
                (None, Some(hex_digest)) => {
                    let bytes = hex::decode(hex_digest)?;
                    bytes.try_into().map_err(|_| anyhow::anyhow!("tokens[{index}].token_sha256: bad length"))?
                }
                (None, None) => anyhow::bail!("tokens[{index}]: no token"),
            };
            tokens.push(TokenEntry {
                digest,
                principal: Principal {
                    role: config.role,
                    agents: Arc::new(config.agents.iter().cloned().collect()),
                    name: config.name.clone().unwrap_or_else(|| format!("token#{index}")).into(),
                },
            });
        }
        Ok(Auth { tokens: Arc::new(tokens) })
    }

    pub fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Authenticates the `authorization: Bearer ...` header and authorizes the path.
    pub fn check(&self, path: &str, headers: &http::HeaderMap) -> Result<Principal, Status> {
        if path.starts_with("/grpc.health.v1.Health/") {
            return Ok(Principal { role: Role::Analytics, agents: Arc::default(), name: "health".into() });
        }
        let principal = if self.is_open() {
            Principal { role: Role::Admin, agents: Arc::default(), name: "open".into() }
        } else {
            let header = headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| Status::unauthenticated("missing authorization: Bearer <token>"))?;
            let token =
                bearer_token(header).ok_or_else(|| Status::unauthenticated("authorization must be Bearer <token>"))?;
            let digest: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
            // Compare against every entry so timing does not reveal which one matched.
            let mut found = None;
            for entry in self.tokens.iter() {
                if constant_time_eq(&entry.digest, &digest) && found.is_none() {
                    found = Some(entry.principal.clone());
                }
            }
            found.ok_or_else(|| Status::unauthenticated("unknown token"))?
        };
        if !allowed(principal.role, path) {
            tracing::info!(token = %principal.name, path, "permission denied");
            return Err(Status::permission_denied(format!(
                "role {:?} may not call {}",
                principal.role,
                anima_engine::validate::echo(path)
            )));
        }
        Ok(principal)
    }
}

/// The token of an `authorization` header value: the auth scheme is case-insensitive (RFC 9110
/// §11.1), so `Bearer`, `bearer` and `BEARER` all work.
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// The tower layer that runs [`Auth::check`] on every request.
#[derive(Clone)]
pub struct AuthLayer(pub Auth);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService { inner, auth: self.0.clone() }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Auth,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for AuthService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        match self.auth.check(request.uri().path(), request.headers()) {
            Ok(principal) => {
                request.extensions_mut().insert(principal);
                // Take the service that was driven to readiness; leave a clone in its place.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(inner.call(request))
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}
