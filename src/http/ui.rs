//! The live dashboard at `/ui`: one static page (HTML, JavaScript and CSS
//! compiled into the binary from `ui/`; no framework, no CDN, nothing fetched
//! at run time) that polls the admin endpoints every second and draws what
//! coalescing, the jobs and the targets are doing.
//!
//! The page itself is public and holds no data (`/ui/sign-in` says only
//! whether the gateway has an admin key at all). It asks for an admin key,
//! keeps it in the tab's `sessionStorage` (gone when the tab closes, never in
//! a cookie, so no other site can make the browser send it) and sends it as
//! `Authorization: Bearer` on its own `fetch` calls to `/v1/stats`,
//! `/v1/admin/routes` and `/v1/admin/jobs`, which check it like any other
//! client's. The key never appears in a URL, so access logs, proxies and
//! the `Referer` header never see it; a job is addressed as `/ui#/jobs/ID`,
//! whose fragment stays in the browser too. Tenants choose some of what the
//! page shows (idempotency keys, metadata), so the script writes text only
//! with `textContent`, and the Content-Security-Policy below allows scripts
//! from this origin only: injected text can neither run nor send the key
//! elsewhere.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::ApiPath;
use super::AppState;
use super::error::ApiError;

const INDEX_HTML: &str = include_str!("../../ui/index.html");
const APP_JS: &str = include_str!("../../ui/app.js");
const APP_CSS: &str = include_str!("../../ui/app.css");

/// Scripts, styles and API calls from this origin only; no frames, no
/// forms posted elsewhere, no plugins.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; \
    frame-ancestors 'none'";

/// The dashboard's routes: the page, its two assets, and what its sign-in
/// card needs to know.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/ui", get(index))
        .route("/ui/", get(index))
        .route("/ui/sign-in", get(sign_in))
        .route("/ui/{asset}", get(asset))
}

/// `GET /ui/sign-in`: whether this gateway has an admin key at all (the
/// embedded default has none), so that the sign-in card can say how to set
/// one instead of refusing every key as "not an admin key". Public, like the
/// page: it tells whether the dashboard can be opened, nothing more.
async fn sign_in(State(state): State<AppState>) -> Response {
    let configured = !state.live.load().config.admin.api_keys.is_empty();
    let mut resp = Json(json!({ "admin_key_configured": configured })).into_response();
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

async fn index() -> Response {
    static_file("text/html; charset=utf-8", INDEX_HTML)
}

async fn asset(ApiPath(name): ApiPath<String>) -> Result<Response, ApiError> {
    match name.as_str() {
        "app.js" => Ok(static_file("text/javascript; charset=utf-8", APP_JS)),
        "app.css" => Ok(static_file("text/css; charset=utf-8", APP_CSS)),
        _ => Err(ApiError::NotFound("route")),
    }
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Revalidate every time: after an upgrade the page and its script must
    // not come from two versions.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_assets() {
        for needle in ["/ui/app.js", "/ui/app.css"] {
            assert!(INDEX_HTML.contains(needle), "index.html lacks {needle}");
        }
        // No CDN, no other host: the only absolute URL is SVG's namespace
        // name, which is never fetched.
        for text in [INDEX_HTML, APP_JS, APP_CSS] {
            let text = text.replace("http://www.w3.org/2000/svg", "");
            assert!(!text.contains("http://"), "an absolute http URL");
            assert!(!text.contains("https://"), "an absolute https URL");
            assert!(!text.contains("//cdn"), "a CDN");
        }
        // Data is written as text, never parsed as HTML.
        assert!(!APP_JS.contains("innerHTML"));
        assert!(!APP_JS.contains("insertAdjacentHTML"));
        assert!(!APP_JS.contains("document.write"));
    }
}
