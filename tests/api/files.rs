//! The Files API of the Batch API against the real gateway and store: a
//! file uploaded as a multipart form (its fields in either order) is
//! listed, read and downloaded byte for byte by its tenant only, paged with
//! a cursor, and deleted with its content; a refused upload (too large, a
//! purpose other than `batch`, not `.jsonl`, empty) leaves nothing behind.

use serde_json::Value;

use crate::helpers::*;

pub const BOUNDARY: &str = "idem-test-boundary-7d1f0c";

/// A field of a multipart form: (name, filename for a file, content).
pub type Part<'a> = (&'a str, Option<&'a str>, &'a [u8]);

/// A multipart/form-data body of `parts`, in their order.
pub fn form(parts: &[Part<'_>]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, filename, data) in parts {
        body.extend_from_slice(format!("--{BOUNDARY}\r\n").as_bytes());
        let head = match filename {
            Some(f) => format!(
                "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                 Content-Type: application/octet-stream\r\n\r\n"
            ),
            None => format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n"),
        };
        body.extend_from_slice(head.as_bytes());
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

pub async fn upload(app: &TestApp, key: &str, parts: &[Part<'_>]) -> reqwest::Response {
    app.client
        .post(app.url("/v1/files"))
        .bearer_auth(key)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(form(parts))
        .send()
        .await
        .unwrap()
}

/// `n` lines of a batch input, about `n * 100` bytes.
fn jsonl(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            format!(
                "{{\"custom_id\":\"req-{i}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\
                 \"body\":{{\"model\":\"gpt-4o-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"{i}\"}}]}}}}\n"
            )
        })
        .collect::<String>()
        .into_bytes()
}

async fn listed(app: &TestApp, key: &str, query: &str) -> Value {
    let (status, v) = app.get_json(key, &format!("/v1/files{query}")).await;
    assert_eq!(status, 200, "{v}");
    v
}

fn ids(list: &Value) -> Vec<String> {
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_file_is_uploaded_listed_downloaded_and_deleted_by_its_tenant_only() {
    let app = TestApp::spawn().await;
    // Three parts in the store (1 MiB each at most), the file first and
    // its purpose after it, as the Node SDK sends them.
    let big = jsonl(30_000);
    assert!(big.len() > 2 * 1024 * 1024);
    let r = upload(
        &app,
        ACME,
        &[
            ("file", Some("big.jsonl"), &big),
            ("purpose", None, b"batch"),
        ],
    )
    .await;
    assert_eq!(r.status(), 200);
    let first: Value = r.json().await.unwrap();
    assert_eq!(first["object"], "file");
    assert_eq!(first["purpose"], "batch");
    assert_eq!(first["status"], "processed");
    assert_eq!(first["filename"], "big.jsonl");
    assert_eq!(first["bytes"], big.len() as u64);
    let created = first["created_at"].as_i64().unwrap();
    assert!(first["expires_at"].as_i64().unwrap() >= created + 30 * 24 * 3600 - 1);
    let first_id = first["id"].as_str().unwrap().to_owned();
    assert!(first_id.starts_with("file-"), "{first_id}");

    // The purpose first, as the Python SDK sends it, and an expiry.
    let small = b"{\"custom_id\":\"a\"}\n{\"custom_id\":\"b\"}";
    let r = upload(
        &app,
        ACME,
        &[
            ("purpose", None, b"batch"),
            ("expires_after[anchor]", None, b"created_at"),
            ("expires_after[seconds]", None, b"3600"),
            ("file", Some("small.jsonl"), small),
        ],
    )
    .await;
    assert_eq!(r.status(), 200);
    let second: Value = r.json().await.unwrap();
    assert_eq!(
        second["expires_at"].as_i64().unwrap() - second["created_at"].as_i64().unwrap(),
        3600
    );
    let second_id = second["id"].as_str().unwrap().to_owned();

    let (status, v) = app.get_json(ACME, &format!("/v1/files/{first_id}")).await;
    assert_eq!(status, 200);
    assert_eq!(v, first);
    let r = app
        .client
        .get(app.url(&format!("/v1/files/{first_id}/content")))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.bytes().await.unwrap().as_ref(),
        &big[..],
        "the content as uploaded"
    );

    // Newest first, a page at a time; oldest first on asking.
    let all = listed(&app, ACME, "").await;
    assert_eq!(ids(&all), [second_id.clone(), first_id.clone()]);
    assert_eq!(all["has_more"], false);
    let page = listed(&app, ACME, "?limit=1").await;
    assert_eq!(ids(&page), [second_id.as_str()]);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["last_id"], second_id.as_str());
    let page = listed(&app, ACME, &format!("?limit=1&after={second_id}")).await;
    assert_eq!(ids(&page), [first_id.as_str()]);
    assert_eq!(page["has_more"], false);
    assert_eq!(
        ids(&listed(&app, ACME, "?order=asc&purpose=batch").await),
        [first_id.clone(), second_id.clone()]
    );

    // Another tenant: nothing, not even a 403.
    assert!(ids(&listed(&app, BETA, "").await).is_empty());
    for path in [
        format!("/v1/files/{first_id}"),
        format!("/v1/files/{first_id}/content"),
    ] {
        let (status, v) = app.get_json(BETA, &path).await;
        assert_eq!(status, 404, "{path}: {v}");
    }
    let r = app
        .client
        .delete(app.url(&format!("/v1/files/{first_id}")))
        .bearer_auth(BETA)
        .send()
        .await
        .unwrap();
    assert_error(r, 404, "not_found").await;

    let r = app
        .client
        .delete(app.url(&format!("/v1/files/{first_id}")))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["deleted"], true);
    assert_eq!(v["id"], first_id.as_str());
    let (status, _) = app
        .get_json(ACME, &format!("/v1/files/{first_id}/content"))
        .await;
    assert_eq!(status, 404);
    assert_eq!(ids(&listed(&app, ACME, "").await), [second_id]);
    app.stop().await;
}

#[tokio::test]
async fn a_refused_upload_leaves_nothing_behind() {
    let app = TestApp::with_config(Spec::default(), |text, _| {
        format!("{text}\n[batches]\nmax_file_bytes = 1500000\n")
    })
    .await;
    // Past the limit: refused as it arrives, its parts deleted.
    let r = upload(
        &app,
        ACME,
        &[
            ("purpose", None, b"batch"),
            ("file", Some("big.jsonl"), &jsonl(20_000)),
        ],
    )
    .await;
    assert_error(r, 413, "request_too_large").await;
    let cases: [(&[Part<'_>], u16, &str); 6] = [
        (
            &[
                ("purpose", None, b"fine-tune"),
                ("file", Some("a.jsonl"), b"{}\n"),
            ],
            400,
            "invalid_value",
        ),
        (
            &[
                ("purpose", None, b"batch"),
                ("file", Some("a.txt"), b"{}\n"),
            ],
            400,
            "invalid_file_format",
        ),
        (
            &[("purpose", None, b"batch"), ("file", Some("a.jsonl"), b"")],
            400,
            "invalid_file_format",
        ),
        (
            &[("file", Some("a.jsonl"), b"{}\n")],
            400,
            "missing_required_parameter",
        ),
        (
            &[("purpose", None, b"batch")],
            400,
            "missing_required_parameter",
        ),
        (
            &[
                ("purpose", None, b"batch"),
                ("color", None, b"red"),
                ("file", Some("a.jsonl"), b"{}\n"),
            ],
            400,
            "unknown_parameter",
        ),
    ];
    for (parts, status, code) in cases {
        assert_error(upload(&app, ACME, parts).await, status, code).await;
    }
    // Not a form at all.
    let r = app
        .client
        .post(app.url("/v1/files"))
        .bearer_auth(ACME)
        .json(&serde_json::json!({"purpose": "batch"}))
        .send()
        .await
        .unwrap();
    assert_error(r, 400, "invalid_multipart").await;
    // An admin key holds no files.
    let r = upload(
        &app,
        ADMIN,
        &[
            ("purpose", None, b"batch"),
            ("file", Some("a.jsonl"), b"{}\n"),
        ],
    )
    .await;
    assert_eq!(r.status(), 403);
    assert!(ids(&listed(&app, ACME, "").await).is_empty());
    // Nothing of the refused uploads is left in the store either.
    let store = app.state.store.clone();
    assert!(
        store
            .list_files("acme", None, None, idem::store::Order::Ascending, 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.sweep_files(i64::MAX, 0).await.unwrap(),
        0,
        "an upload left behind"
    );
    app.stop().await;
}
