//! Over-size requests answered as the API says: `RESOURCE_EXHAUSTED` naming the limit.
//!
//! tonic refuses a request message larger than its decoding limit (4 MiB by default) inside the
//! generated service, before any handler runs, and answers `OUT_OF_RANGE` "Error, decoded message
//! length too large: found N bytes, the limit is: L bytes". The server cannot choose that code,
//! so this layer, the innermost, rewrites exactly that answer (a trailers-only response whose
//! status is in the headers) into `RESOURCE_EXHAUSTED` "request: N bytes; the transport limit is
//! L bytes per message". Likewise a request body that does not decode as the RPC's message,
//! which tonic-prost answers `INTERNAL` (the gRPC convention for parse errors, but to a client
//! it reads as a server bug): it becomes `INVALID_ARGUMENT` "request: not a valid <message> ...",
//! with prost's description clipped; and a unary call that sent no request message at all, which
//! tonic answers `INTERNAL` "Missing request message.", becomes `INVALID_ARGUMENT` too. Every
//! other response passes untouched. A bad message in the middle of a client stream
//! (`AppendStream`) reaches the handler as an item error, after the headers this layer sees: the
//! handler rewrites it the same way ([`client_facing`]).

use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tonic::{Code, Status};

/// Start of tonic 0.14's message for a request over its decoding limit.
const TONIC_TOO_LARGE: &str = "Error, decoded message length too large: found ";
/// Start of prost's message (through tonic-prost) for bytes that do not decode.
const PROST_UNDECODABLE: &str = "failed to decode Protobuf message: ";
/// tonic's message for a unary call that ended its request stream without a message.
const TONIC_MISSING: &str = "Missing request message.";

#[derive(Clone, Copy)]
pub struct TransportLimitLayer;

impl<S> tower::Layer<S> for TransportLimitLayer {
    type Service = TransportLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        TransportLimitService { inner }
    }
}

#[derive(Clone)]
pub struct TransportLimitService<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for TransportLimitService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        // Take the service that was driven to readiness; leave a clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let mut response = inner.call(request).await?;
            if let Some(status) = rewritten(response.headers()) {
                // Replacing a well-formed status cannot fail; keep tonic's answer if it did.
                if status.add_header(response.headers_mut()).is_ok() {
                    response.extensions_mut().insert(status);
                }
            }
            Ok(response)
        })
    }
}

/// The answer the API promises for tonic's refusal in `headers`, if they carry one to rewrite.
fn rewritten(headers: &http::HeaderMap) -> Option<Status> {
    promised(&Status::from_header_map(headers)?)
}

/// The answer the API promises for a refusal tonic made while reading a request; `None` for any
/// other status.
fn promised(status: &Status) -> Option<Status> {
    match status.code() {
        Code::OutOfRange => over_the_limit(status),
        Code::Internal => undecodable(status).or_else(|| missing(status)),
        _ => None,
    }
}

/// `status` as the API promises it, for a handler reading the items of a client stream itself
/// (tonic hands it a decoding failure as `INTERNAL`, and this layer only sees the headers).
pub fn client_facing(status: Status) -> Status {
    promised(&status).unwrap_or(status)
}

/// `INVALID_ARGUMENT` for a unary call whose client sent no request message at all (tonic:
/// `INTERNAL` "Missing request message.").
fn missing(status: &Status) -> Option<Status> {
    (status.message() == TONIC_MISSING)
        .then(|| Status::invalid_argument("request: missing; this RPC takes exactly one request message"))
}

/// `INVALID_ARGUMENT` for a body that is not the RPC's message.
fn undecodable(status: &Status) -> Option<Status> {
    let detail = status.message().strip_prefix(PROST_UNDECODABLE)?;
    Some(Status::invalid_argument(format!(
        "request: not a valid message of this RPC ({})",
        anima_engine::validate::echo(detail)
    )))
}

/// `RESOURCE_EXHAUSTED` naming the limit for tonic's over-the-limit refusal.
fn over_the_limit(status: &Status) -> Option<Status> {
    let sizes = status.message().strip_prefix(TONIC_TOO_LARGE)?;
    let (found, limit) = sizes.split_once(" bytes, the limit is: ")?;
    let limit = limit.strip_suffix(" bytes")?;
    let (found, limit): (u64, u64) = (found.parse().ok()?, limit.parse().ok()?);
    Some(Status::resource_exhausted(format!(
        "request: {found} bytes; the transport limit is {limit} bytes per message"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers_of(status: Status) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        status.add_header(&mut headers).expect("a valid status");
        headers
    }

    #[test]
    fn tonics_refusal_of_a_large_request_becomes_resource_exhausted_naming_the_limit() {
        let tonic = Status::out_of_range(
            "Error, decoded message length too large: found 5242885 bytes, the limit is: 4194304 bytes",
        );
        let status = rewritten(&headers_of(tonic)).expect("rewritten");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "request: 5242885 bytes; the transport limit is 4194304 bytes per message");
    }

    #[test]
    fn an_undecodable_body_becomes_invalid_argument() {
        let tonic = Status::internal("failed to decode Protobuf message: AppendRequest.observation: invalid wire type");
        let status = rewritten(&headers_of(tonic)).expect("rewritten");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().starts_with("request: not a valid message of this RPC"), "{}", status.message());
    }

    #[test]
    fn a_unary_call_without_a_request_message_becomes_invalid_argument() {
        let status = rewritten(&headers_of(Status::internal("Missing request message."))).expect("rewritten");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().starts_with("request: missing"), "{}", status.message());
    }

    #[test]
    fn a_stream_item_that_does_not_decode_becomes_invalid_argument() {
        let item = Status::internal("failed to decode Protobuf message: buffer underflow");
        let status = client_facing(item);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().starts_with("request: not a valid message of this RPC"), "{}", status.message());
        assert_eq!(client_facing(Status::unavailable("log down")).code(), Code::Unavailable);
    }

    #[test]
    fn every_other_status_passes_untouched() {
        assert!(rewritten(&headers_of(Status::out_of_range("seq 9 is beyond the newest event"))).is_none());
        assert!(rewritten(&headers_of(Status::invalid_argument("ts: bad"))).is_none());
        assert!(rewritten(&http::HeaderMap::new()).is_none());
        assert!(rewritten(&headers_of(Status::internal("the fold stopped"))).is_none());
    }
}
