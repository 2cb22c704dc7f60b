//! A provider's own Batch API (OpenAI's, `batch_api = true` on an `openai`
//! provider): a file of request lines uploaded, one provider batch made
//! of it, asked now and then whether it has ended, and its output and
//! error files read back a line at a time. What to send and what the
//! answers complete is the batch driver's (docs/design.md, "Batches").

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use reqwest::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{Value, json};

/// Why a call to a provider's Batch API did not give what was asked.
#[derive(Debug, thiserror::Error)]
pub enum BatchApiError {
    /// Nothing came back: the request may or may not have been taken.
    #[error("the provider's Batch API could not be reached: {0}")]
    Transport(#[source] reqwest::Error),
    /// The provider answered with an error: it took nothing.
    #[error("the provider's Batch API answered {status}: {body}")]
    Refused { status: u16, body: String },
    /// A 2xx that is not what its API returns.
    #[error("the provider's Batch API answered something unreadable: {0}")]
    Unreadable(String),
}

/// A provider batch as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProviderBatch {
    pub id: String,
    pub status: String,
    #[serde(default)]
    pub output_file_id: Option<String>,
    #[serde(default)]
    pub error_file_id: Option<String>,
}

impl ProviderBatch {
    /// Whether it will not change any more.
    pub fn ended(&self) -> bool {
        matches!(
            self.status.as_str(),
            "completed" | "failed" | "expired" | "cancelled"
        )
    }
}

/// One provider's Batch API endpoints and credentials.
#[derive(Debug)]
pub struct BatchApi {
    files: reqwest::Url,
    batches: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// How often a provider batch is asked whether it has ended.
    pub poll: Duration,
}

impl BatchApi {
    pub fn new(
        base_url: &str,
        headers: Vec<(HeaderName, HeaderValue)>,
        poll: Duration,
    ) -> Result<BatchApi, String> {
        let base = base_url.trim_end_matches('/');
        let url = |path: &str| {
            reqwest::Url::parse(&format!("{base}{path}"))
                .map_err(|e| format!("{base:?} is not a URL: {e}"))
        };
        Ok(BatchApi {
            files: url("/files")?,
            batches: url("/batches")?,
            headers,
            poll,
        })
    }

    fn with_headers(&self, mut r: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        for (k, v) in &self.headers {
            r = r.header(k, v);
        }
        r
    }

    async fn json<T: for<'de> Deserialize<'de>>(
        r: reqwest::RequestBuilder,
    ) -> Result<T, BatchApiError> {
        let resp = r.send().await.map_err(BatchApiError::Transport)?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(BatchApiError::Transport)?;
        if !status.is_success() {
            return Err(BatchApiError::Refused {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).chars().take(500).collect(),
            });
        }
        serde_json::from_slice(&body).map_err(|e| BatchApiError::Unreadable(e.to_string()))
    }

    /// Uploads `bytes` bytes of request lines (`purpose=batch`) from
    /// `body`, a stream: the provider's file id.
    pub async fn upload<S>(
        &self,
        client: &reqwest::Client,
        name: String,
        bytes: u64,
        body: S,
    ) -> Result<String, BatchApiError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let part =
            reqwest::multipart::Part::stream_with_length(reqwest::Body::wrap_stream(body), bytes)
                .file_name(name)
                .mime_str("application/jsonl")
                .map_err(BatchApiError::Transport)?;
        let form = reqwest::multipart::Form::new()
            .text("purpose", "batch")
            .part("file", part);
        #[derive(Deserialize)]
        struct File {
            id: String,
        }
        let file: File =
            Self::json(self.with_headers(client.post(self.files.clone()).multipart(form))).await?;
        Ok(file.id)
    }

    /// Makes a provider batch of the uploaded `file` for `endpoint`.
    pub async fn create(
        &self,
        client: &reqwest::Client,
        file: &str,
        endpoint: &str,
        metadata: Value,
    ) -> Result<ProviderBatch, BatchApiError> {
        let body = json!({
            "input_file_id": file,
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": metadata,
        });
        Self::json(self.with_headers(client.post(self.batches.clone()).json(&body))).await
    }

    /// The provider batch `id` as it is now.
    pub async fn get(
        &self,
        client: &reqwest::Client,
        id: &str,
    ) -> Result<ProviderBatch, BatchApiError> {
        let url = format!("{}/{id}", self.batches);
        Self::json(self.with_headers(client.get(url))).await
    }

    /// Asks the provider to cancel batch `id` (what has run stays run).
    pub async fn cancel(
        &self,
        client: &reqwest::Client,
        id: &str,
    ) -> Result<ProviderBatch, BatchApiError> {
        let url = format!("{}/{id}/cancel", self.batches);
        Self::json(self.with_headers(client.post(url))).await
    }

    /// The lines of the provider's file `id` (an output or error file), read
    /// as they arrive; a line longer than `max_line` is an error.
    pub async fn lines(
        &self,
        client: &reqwest::Client,
        id: &str,
        max_line: usize,
    ) -> Result<Lines, BatchApiError> {
        let url = format!("{}/{id}/content", self.files);
        let resp = self
            .with_headers(client.get(url))
            .send()
            .await
            .map_err(BatchApiError::Transport)?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(BatchApiError::Refused {
                status: status.as_u16(),
                body: body.chars().take(500).collect(),
            });
        }
        Ok(Lines {
            body: Box::pin(resp.bytes_stream()),
            buf: BytesMut::new(),
            max_line,
            done: false,
        })
    }
}

/// A provider file read a line at a time.
pub struct Lines {
    body: std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    buf: BytesMut,
    max_line: usize,
    done: bool,
}

impl Lines {
    /// The next line that is not blank (without its newline), or None at
    /// the end.
    pub async fn next(&mut self) -> Result<Option<Bytes>, BatchApiError> {
        loop {
            if let Some(i) = memchr::memchr(b'\n', &self.buf) {
                let line = self.buf.split_to(i + 1).freeze().slice(..i);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(line));
            }
            if self.buf.len() > self.max_line {
                return Err(BatchApiError::Unreadable(format!(
                    "a line longer than {} bytes",
                    self.max_line
                )));
            }
            if self.done {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                return Ok(Some(self.buf.split().freeze()));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(BatchApiError::Transport(e)),
                None => self.done = true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(chunks: &[&'static str], max_line: usize) -> Lines {
        let chunks: Vec<reqwest::Result<Bytes>> = chunks
            .iter()
            .map(|c| Ok(Bytes::from_static(c.as_bytes())))
            .collect();
        Lines {
            body: Box::pin(futures_util::stream::iter(chunks)),
            buf: BytesMut::new(),
            max_line,
            done: false,
        }
    }

    #[tokio::test]
    async fn lines_are_cut_wherever_the_chunks_end_and_blank_ones_skipped() {
        let mut l = lines(&["{\"a\"", ":1}\n\n  \n{\"b\":2}\n{\"c\"", ":3}"], 64);
        let mut got = Vec::new();
        while let Some(line) = l.next().await.unwrap() {
            got.push(String::from_utf8(line.to_vec()).unwrap());
        }
        assert_eq!(got, ["{\"a\":1}", "{\"b\":2}", "{\"c\":3}"]);
    }

    #[tokio::test]
    async fn a_line_past_the_limit_is_an_error() {
        let mut l = lines(&["0123456789", "0123456789\n"], 8);
        assert!(matches!(l.next().await, Err(BatchApiError::Unreadable(_))));
    }

    #[test]
    fn a_provider_batch_has_ended_in_its_final_statuses() {
        let b = |status: &str| ProviderBatch {
            id: "b".into(),
            status: status.into(),
            output_file_id: None,
            error_file_id: None,
        };
        for s in ["completed", "failed", "expired", "cancelled"] {
            assert!(b(s).ended(), "{s}");
        }
        for s in ["validating", "in_progress", "finalizing", "cancelling"] {
            assert!(!b(s).ended(), "{s}");
        }
    }
}
