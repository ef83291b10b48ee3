//! `--api-key` / `KVLEASE_API_KEY`: the HTTP API's bearer key, as vLLM's `--api-key`.
//!
//! Every route but `/health` and `/metrics` (which routers and Prometheus poll) needs
//! `Authorization: Bearer <key>`; vLLM's proxies already send it. A missing or wrong key
//! is a 401 in the API's JSON error shape. The comparison takes the same time whatever
//! prefix matches.

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;
use crate::config::AuthToken;

/// Paths that stay open with a key set.
const OPEN: [&str; 2] = ["/health", "/metrics"];

/// `router`, requiring `key` on every route but `/health` and `/metrics`; unchanged without
/// a key.
pub fn protect(router: Router, key: Option<&AuthToken>) -> Router {
    let Some(key) = key else {
        return router;
    };
    let mut want = b"Bearer ".to_vec();
    want.extend_from_slice(key.as_bytes());
    let want: Arc<[u8]> = want.into();
    router.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let want = Arc::clone(&want);
            async move { check(&want, req, next).await }
        },
    ))
}

async fn check(want: &[u8], req: Request, next: Next) -> Response {
    if OPEN.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(axum::http::HeaderValue::as_bytes);
    if given.is_some_and(|g| same(g, want)) {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "missing or wrong API key (send Authorization: Bearer <--api-key>)",
    )
    .into_response()
}

/// Byte equality in time that depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_is_exact() {
        assert!(same(b"Bearer k", b"Bearer k"));
        assert!(!same(b"Bearer k", b"Bearer j"));
        assert!(!same(b"Bearer k", b"Bearer kk"));
        assert!(!same(b"", b"Bearer k"));
    }
}
