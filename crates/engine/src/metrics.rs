//! A hook for measuring the log's appends without the engine knowing any metrics library: an
//! [`AppendObserver`] is told how long every append took, and [`ObservedLog`] is the
//! [`EventLog`] decorator that tells it. The instance wraps its log in one when its config names
//! an observer, so every append (command handlers, agent sync, recovery) is measured in one place
//! and nothing else changes: reads, follows and the identity go straight to the inner log.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::BoxStream;

use crate::log::{AppendOutcome, AppendRecord, EventLog, LogResult, StoredRecord, SubjectFilter};

/// Which append call was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendCall {
    /// [`EventLog::append`]: one record.
    One,
    /// [`EventLog::append_batch`]: several records, pipelined.
    Batch,
}

impl AppendCall {
    pub fn as_str(self) -> &'static str {
        match self {
            AppendCall::One => "append",
            AppendCall::Batch => "append_batch",
        }
    }
}

/// Told about every append after it returned. Must be cheap and must not block: it runs on the
/// request's task.
pub trait AppendObserver: Send + Sync + std::fmt::Debug + 'static {
    /// `records` were appended (or refused: `ok` is false) by `call` in `elapsed`.
    fn appended(&self, call: AppendCall, records: usize, elapsed: Duration, ok: bool);
}

/// An [`EventLog`] that reports the duration of every append to an [`AppendObserver`].
pub struct ObservedLog {
    inner: Arc<dyn EventLog>,
    observer: Arc<dyn AppendObserver>,
}

impl ObservedLog {
    pub fn new(inner: Arc<dyn EventLog>, observer: Arc<dyn AppendObserver>) -> Self {
        ObservedLog { inner, observer }
    }
}

#[async_trait::async_trait]
impl EventLog for ObservedLog {
    fn identity(&self) -> String {
        self.inner.identity()
    }

    fn subjects(&self) -> &crate::subject::Subjects {
        self.inner.subjects()
    }

    async fn append(&self, record: AppendRecord) -> LogResult<AppendOutcome> {
        let started = Instant::now();
        let result = self.inner.append(record).await;
        self.observer.appended(AppendCall::One, 1, started.elapsed(), result.is_ok());
        result
    }

    async fn append_batch(&self, records: Vec<AppendRecord>) -> LogResult<Vec<AppendOutcome>> {
        let count = records.len();
        let started = Instant::now();
        let result = self.inner.append_batch(records).await;
        self.observer.appended(AppendCall::Batch, count, started.elapsed(), result.is_ok());
        result
    }

    async fn read(
        &self,
        from_seq: u64,
        to_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        self.inner.read(from_seq, to_seq, filter).await
    }

    async fn follow(
        &self,
        from_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        self.inner.follow(from_seq, filter).await
    }

    async fn get(&self, seq: u64) -> LogResult<Option<StoredRecord>> {
        self.inner.get(seq).await
    }

    async fn last_seq(&self) -> LogResult<u64> {
        self.inner.last_seq().await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use bytes::Bytes;

    use super::*;
    use crate::log::embedded::{EmbeddedConfig, EmbeddedLog};

    #[derive(Debug, Default)]
    struct Recorded(Mutex<Vec<(AppendCall, usize, bool)>>);

    impl AppendObserver for Recorded {
        fn appended(&self, call: AppendCall, records: usize, _elapsed: Duration, ok: bool) {
            self.0.lock().unwrap().push((call, records, ok));
        }
    }

    fn record(id: &str) -> AppendRecord {
        AppendRecord { subject: "anima.v1.config".into(), msg_id: id.into(), payload: Bytes::from_static(b"x") }
    }

    #[tokio::test]
    async fn every_append_is_reported_and_reads_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let inner: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).unwrap());
        let recorded = Arc::new(Recorded::default());
        let log = ObservedLog::new(inner.clone(), recorded.clone());
        log.append(record("a")).await.unwrap();
        log.append_batch(vec![record("b"), record("c")]).await.unwrap();
        log.append(record("")).await.unwrap_err();
        assert_eq!(
            *recorded.0.lock().unwrap(),
            vec![(AppendCall::One, 1, true), (AppendCall::Batch, 2, true), (AppendCall::One, 1, false)]
        );
        assert_eq!(log.last_seq().await.unwrap(), 3);
        assert_eq!(log.identity(), inner.identity());
        assert_eq!(log.get(2).await.unwrap().unwrap().payload, Bytes::from_static(b"x"));
    }
}
