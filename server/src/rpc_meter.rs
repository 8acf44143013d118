//! Counts every ublkd RPC in `ublkd_grpc_requests_total`, including those tonic refuses before
//! a handler runs (a request that does not decode, or one over the size limit), and gives an
//! oversized request RESOURCE_EXHAUSTED, the gRPC convention, instead of tonic's OUT_OF_RANGE.
//!
//! A unary gRPC call's status is in the response headers (a trailers-only response: a handler's
//! error) or in the trailers (a success, or tonic's refusal of a request body it could not
//! decode); the response body is wrapped to read, and for an oversized request rewrite, those.

use crate::metrics::Metrics;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;
use tonic::codegen::http;
use tonic::Code;

/// The ublkd API's services; health and reflection are not counted.
const API_PREFIX: &str = "/ublkd.v1.";

/// The layer stack of ublkd's gRPC servers.
pub type Stack = tower::layer::util::Stack<
    crate::authz::AuthzLayer,
    tower::layer::util::Stack<MeterLayer, tower::layer::util::Identity>,
>;

#[derive(Debug, Clone)]
pub struct MeterLayer {
    pub metrics: Metrics,
}

impl<S> tower::Layer<S> for MeterLayer {
    type Service = Meter<S>;

    fn layer(&self, inner: S) -> Meter<S> {
        Meter {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Meter<S> {
    inner: S,
    metrics: Metrics,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Meter<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<http::Response<tonic::body::Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        let method = path
            .starts_with(API_PREFIX)
            .then(|| path.rsplit('/').next().unwrap_or("").to_owned());
        let metrics = self.metrics.clone();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let Some(method) = method else {
                return Ok(resp);
            };
            let outcome = Outcome {
                metrics,
                method,
                start,
                recorded: false,
            };
            if status_in(resp.headers()).is_some() {
                // Trailers-only: a handler's error, or tonic refusing the request body.
                outcome.record(settle(resp.headers_mut()));
                return Ok(resp);
            }
            Ok(resp.map(|inner| {
                tonic::body::Body::new(MeteredBody {
                    inner,
                    outcome: Some(outcome),
                })
            }))
        })
    }
}

/// One call to record, once.
#[derive(Debug)]
struct Outcome {
    metrics: Metrics,
    method: String,
    start: Instant,
    recorded: bool,
}

impl Outcome {
    fn record(mut self, code: Code) {
        self.recorded = true;
        self.metrics.rpc(&self.method, code, self.start.elapsed());
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        // A body dropped before its trailers: the client went away.
        if !self.recorded {
            self.metrics
                .rpc(&self.method, Code::Cancelled, self.start.elapsed());
        }
    }
}

/// A response body whose trailers give the call's status.
struct MeteredBody {
    inner: tonic::body::Body,
    outcome: Option<Outcome>,
}

impl http_body::Body for MeteredBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                let Poll::Ready(Some(Ok(mut frame))) = polled else {
                    return polled;
                };
                if let Some(trailers) = frame.trailers_mut() {
                    let code = settle(trailers);
                    if let Some(o) = self.outcome.take() {
                        o.record(code);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                // The stream ended without trailers: nothing said otherwise.
                if let Some(o) = self.outcome.take() {
                    o.record(Code::Ok);
                }
                polled
            }
            _ => polled,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The status in `map` (headers or trailers), if it carries one.
fn status_in(map: &http::HeaderMap) -> Option<Code> {
    map.get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from_i32)
}

/// The final status of a headers or trailers map: tonic's OUT_OF_RANGE for an oversized request becomes
/// RESOURCE_EXHAUSTED (rewritten in place); no status means OK.
fn settle(trailers: &mut http::HeaderMap) -> Code {
    let code = status_in(trailers).unwrap_or(Code::Ok);
    if code == Code::OutOfRange && too_large(trailers) {
        trailers.insert(
            "grpc-status",
            http::HeaderValue::from(Code::ResourceExhausted as i32),
        );
        return Code::ResourceExhausted;
    }
    code
}

/// Tonic's own refusal of a message over the decoding limit (handlers never say OUT_OF_RANGE).
fn too_large(map: &http::HeaderMap) -> bool {
    map.get("grpc-message")
        .and_then(|v| v.to_str().ok())
        // Percent-encoded on the wire (tonic encodes spaces).
        .is_some_and(|m| m.replace("%20", " ").contains("too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(status: Option<&str>, message: Option<&str>) -> http::HeaderMap {
        let mut m = http::HeaderMap::new();
        if let Some(s) = status {
            m.insert("grpc-status", s.parse().unwrap());
        }
        if let Some(v) = message {
            m.insert("grpc-message", v.parse().unwrap());
        }
        m
    }

    #[test]
    fn status_comes_from_headers_or_trailers() {
        assert_eq!(status_in(&map(None, None)), None);
        assert_eq!(status_in(&map(Some("5"), None)), Some(Code::NotFound));
        assert_eq!(settle(&mut map(None, None)), Code::Ok);
        assert_eq!(settle(&mut map(Some("13"), None)), Code::Internal);
    }

    #[test]
    fn an_oversized_request_gets_resource_exhausted() {
        let mut t = map(
            Some("11"),
            Some("Error,%20decoded%20message%20length%20too%20large:%20found%202097168%20bytes"),
        );
        assert_eq!(settle(&mut t), Code::ResourceExhausted);
        assert_eq!(status_in(&t), Some(Code::ResourceExhausted), "rewritten");
        assert_eq!(
            settle(&mut map(Some("11"), Some("other"))),
            Code::OutOfRange
        );
    }
}
