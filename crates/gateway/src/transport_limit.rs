//! Over-size requests answered as the API says: `RESOURCE_EXHAUSTED` naming the limit.
//!
//! tonic refuses a request message larger than its decoding limit (4 MiB by default) inside the
//! generated service, before any handler runs, and answers `OUT_OF_RANGE` "Error, decoded message
//! length too large: found N bytes, the limit is: L bytes". The server cannot choose that code,
//! so this layer, the innermost, rewrites exactly that answer (a trailers-only response whose
//! status is in the headers) into `RESOURCE_EXHAUSTED` "request: N bytes; the transport limit is
//! L bytes per message". Every other response passes untouched. A message over the limit in the
//! middle of a client stream (`AppendStream`) ends that stream with tonic's status in its
//! trailers, which this layer does not see.

use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tonic::{Code, Status};

/// Start of tonic 0.14's message for a request over its decoding limit.
const TONIC_TOO_LARGE: &str = "Error, decoded message length too large: found ";

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
            if let Some(status) = over_the_limit(response.headers()) {
                // Replacing a well-formed status cannot fail; keep tonic's answer if it did.
                if status.add_header(response.headers_mut()).is_ok() {
                    response.extensions_mut().insert(status);
                }
            }
            Ok(response)
        })
    }
}

/// The `RESOURCE_EXHAUSTED` answer for tonic's over-the-limit refusal, if `headers` carry it.
fn over_the_limit(headers: &http::HeaderMap) -> Option<Status> {
    let status = Status::from_header_map(headers)?;
    if status.code() != Code::OutOfRange {
        return None;
    }
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
        let status = over_the_limit(&headers_of(tonic)).expect("rewritten");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "request: 5242885 bytes; the transport limit is 4194304 bytes per message");
    }

    #[test]
    fn every_other_status_passes_untouched() {
        assert!(over_the_limit(&headers_of(Status::out_of_range("seq 9 is beyond the newest event"))).is_none());
        assert!(over_the_limit(&headers_of(Status::invalid_argument("ts: bad"))).is_none());
        assert!(over_the_limit(&http::HeaderMap::new()).is_none());
    }
}
