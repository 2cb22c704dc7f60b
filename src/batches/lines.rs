//! A batch's files line by line: the input read from the store one part at
//! a time, the output and error files written one part at a time, so that
//! neither is ever whole in memory.

use std::sync::Arc;

use crate::store::{FileRecord, PART_BYTES, Store, StoreError, now_ms};

/// The longest line a batch reads (a longer one fails the batch in
/// validation, as a line that is not JSON would).
pub const MAX_LINE_BYTES: usize = 8 << 20;

/// One line of an input file.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// Its bytes, without the newline (and a `\r` before it).
    Text(Vec<u8>),
    /// Longer than [`MAX_LINE_BYTES`]; its bytes are skipped.
    TooLong,
}

/// Reads a file's lines in order, one part of the store at a time. Empty
/// lines are lines too (the caller decides); a last line without a
/// newline counts.
pub struct LineReader {
    store: Arc<dyn Store>,
    file_id: String,
    next_part: i32,
    /// Bytes read and not yet handed out.
    buf: Vec<u8>,
    /// Where in `buf` the next line starts.
    at: usize,
    /// The store has no more parts.
    ended: bool,
    /// Skipping the rest of a line that is too long.
    skipping: bool,
}

impl LineReader {
    pub fn new(store: Arc<dyn Store>, file_id: &str) -> LineReader {
        LineReader {
            store,
            file_id: file_id.to_string(),
            next_part: 0,
            buf: Vec::new(),
            at: 0,
            ended: false,
            skipping: false,
        }
    }

    /// The next line, or None at the end of the file.
    pub async fn next(&mut self) -> Result<Option<Line>, StoreError> {
        loop {
            if let Some(nl) = self.buf[self.at..].iter().position(|b| *b == b'\n') {
                let start = self.at;
                self.at += nl + 1;
                if std::mem::take(&mut self.skipping) {
                    return Ok(Some(Line::TooLong));
                }
                let mut line = self.buf[start..start + nl].to_vec();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(Some(Line::Text(line)));
            }
            if self.buf.len() - self.at > MAX_LINE_BYTES {
                // Too long: drop what is held of it and skip to its end.
                self.skipping = true;
                self.buf.clear();
                self.at = 0;
            }
            if self.ended {
                if self.at < self.buf.len() || self.skipping {
                    let start = self.at;
                    self.at = self.buf.len();
                    if std::mem::take(&mut self.skipping) {
                        return Ok(Some(Line::TooLong));
                    }
                    return Ok(Some(Line::Text(self.buf[start..].to_vec())));
                }
                return Ok(None);
            }
            // Compact, then read the next part.
            self.buf.drain(..self.at);
            self.at = 0;
            match self.store.file_part(&self.file_id, self.next_part).await? {
                Some(part) => {
                    self.next_part += 1;
                    self.buf.extend_from_slice(&part);
                }
                None => self.ended = true,
            }
        }
    }
}

/// Writes a file of a batch's results in parts; it becomes visible when
/// [`FileWriter::finish`] is called (a writer that is dropped before
/// leaves an upload the reconciler sweeps).
pub struct FileWriter {
    store: Arc<dyn Store>,
    file: FileRecord,
    buf: Vec<u8>,
    parts: i32,
    begun: bool,
}

impl FileWriter {
    pub fn new(store: Arc<dyn Store>, tenant: &str, filename: String, expires_at: i64) -> Self {
        FileWriter {
            store,
            file: FileRecord {
                id: format!("file-{}", uuid::Uuid::now_v7().simple()),
                tenant: tenant.to_string(),
                purpose: "batch_output".to_string(),
                filename,
                bytes: 0,
                lines: 0,
                created_at: now_ms(),
                expires_at: Some(expires_at),
            },
            buf: Vec::new(),
            parts: 0,
            begun: false,
        }
    }

    /// The file's purpose (`batch_output` unless set).
    #[must_use]
    pub fn purpose(mut self, purpose: &str) -> Self {
        self.file.purpose = purpose.to_string();
        self
    }

    /// Lines written so far.
    pub fn lines(&self) -> i64 {
        self.file.lines
    }

    /// Appends one line (its newline added).
    pub async fn line(&mut self, text: &[u8]) -> Result<(), StoreError> {
        self.buf.extend_from_slice(text);
        self.buf.push(b'\n');
        self.file.lines += 1;
        self.file.bytes += i64::try_from(text.len() + 1).unwrap_or(i64::MAX);
        while self.buf.len() >= PART_BYTES {
            let rest = self.buf.split_off(PART_BYTES);
            let part = std::mem::replace(&mut self.buf, rest);
            self.put(&part).await?;
        }
        Ok(())
    }

    async fn put(&mut self, part: &[u8]) -> Result<(), StoreError> {
        if !self.begun {
            self.store.begin_file(&self.file).await?;
            self.begun = true;
        }
        self.store
            .put_file_part(&self.file.id, self.parts, part)
            .await?;
        self.parts += 1;
        Ok(())
    }

    /// Writes what is left and makes the file visible: its id, or None
    /// when no line was written (no file is made).
    pub async fn finish(mut self) -> Result<Option<String>, StoreError> {
        if self.file.lines == 0 {
            return Ok(None);
        }
        if !self.buf.is_empty() {
            let part = std::mem::take(&mut self.buf);
            self.put(&part).await?;
        }
        if !self.store.finish_file(&self.file).await? {
            return Err(StoreError::Corrupt(format!(
                "file {} was swept while it was written",
                self.file.id
            )));
        }
        Ok(Some(self.file.id))
    }
}
