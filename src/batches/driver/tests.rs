//! The driver's line parsing and its output and error lines.

use super::*;

#[test]
fn lines_are_checked_as_openai_checks_them() {
    let ok =
        br#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}"#;
    let p = parse_line(ok, "/v1/chat/completions").ok().unwrap();
    assert_eq!(p.custom_id, "a");
    assert_eq!(p.body.get("model"), Some(&json!("m")));
    let cases: [(&[u8], &str); 6] = [
        (b"not json", "invalid_json_line"),
        (
            br#"{"method":"POST","url":"/v1/chat/completions","body":{}}"#,
            "missing_required_parameter",
        ),
        (
            br#"{"custom_id":"","method":"POST","url":"/v1/chat/completions","body":{}}"#,
            "invalid_custom_id",
        ),
        (
            br#"{"custom_id":"a","method":"GET","url":"/v1/chat/completions","body":{}}"#,
            "invalid_method",
        ),
        (
            br#"{"custom_id":"a","method":"POST","url":"/v1/embeddings","body":{}}"#,
            "mismatched_endpoint",
        ),
        (
            br#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions"}"#,
            "missing_required_parameter",
        ),
    ];
    for (line, code) in cases {
        match parse_line(line, "/v1/chat/completions") {
            Ok(_) => panic!("{} passed", String::from_utf8_lossy(line)),
            Err(b) => assert_eq!(b.code, code, "{}", String::from_utf8_lossy(line)),
        }
    }
}

fn job(state: JobState, result: Option<&str>, error: Option<&str>) -> JobRecord {
    JobRecord {
        id: "0190a0b0-0000-7000-8000-000000000001".into(),
        tenant: "t".into(),
        idempotency_key: "k".into(),
        payload_hash: "h".into(),
        fingerprint: "f".into(),
        route: "r".into(),
        request: "{}".into(),
        dialect: "chat".into(),
        forwarded: None,
        metadata: None,
        state,
        version: 1,
        completed_by: None,
        result: result.map(str::to_string),
        error: error.map(str::to_string),
        not_before: 0,
        claimed_by: None,
        claim_until: None,
        retries: 0,
        key_id: None,
        batch_id: None,
        created_at: 0,
        updated_at: 0,
    }
}

fn parsed(w: Written) -> (bool, Value) {
    match w {
        Written::Output(t) => (true, serde_json::from_str(&t).unwrap()),
        Written::Error(t) => (false, serde_json::from_str(&t).unwrap()),
    }
}

#[test]
fn output_and_error_lines_have_openais_shape() {
    let ok = job(
        JobState::Succeeded,
        Some(r#"{"id":"chatcmpl-1","object":"chat.completion"}"#),
        None,
    );
    let (out, v) = parsed(output_line("c1", None, Some(&ok), Ending::Completed));
    assert!(out);
    assert_eq!(v["custom_id"], "c1");
    assert_eq!(v["response"]["status_code"], 200);
    assert_eq!(
        v["response"]["body"]["id"], "chatcmpl-1",
        "the answer as it was stored"
    );
    assert_eq!(v["error"], Value::Null);
    assert!(v["id"].as_str().unwrap().starts_with("batch_req_"));

    let failed = job(JobState::Failed, None, Some("all 3 attempts failed"));
    let (out, v) = parsed(output_line("c2", None, Some(&failed), Ending::Completed));
    assert!(!out);
    assert_eq!(v["response"], Value::Null);
    assert_eq!(v["error"]["code"], "request_failed");

    let refusal = LineRefusal {
        status: 400,
        code: "invalid_value".into(),
        message: "messages must be an array".into(),
        param: Some("messages".into()),
        fails_batch: false,
    };
    let (out, v) = parsed(output_line("c3", Some(&refusal), None, Ending::Completed));
    assert!(!out);
    assert_eq!(v["response"]["status_code"], 400);
    assert_eq!(v["response"]["body"]["error"]["param"], "messages");

    let (_, v) = parsed(output_line("c4", None, None, Ending::Cancelled));
    assert_eq!(v["error"]["code"], "batch_cancelled");
    let (_, v) = parsed(output_line("c5", None, None, Ending::Expired));
    assert_eq!(v["error"]["code"], "batch_expired");
    let held = job(JobState::Running, None, None);
    let (_, v) = parsed(output_line("c6", None, Some(&held), Ending::Cancelled));
    assert_eq!(v["error"]["code"], "unknown");
}

fn attempt(state: AttemptState, reason: Option<&str>, started_at: i64) -> AttemptRecord {
    AttemptRecord {
        job_id: "j".into(),
        n: 1,
        provider: "p".into(),
        model: "m".into(),
        state,
        reason: reason.map(str::to_string),
        hedge: false,
        read_version: 0,
        owner: None,
        started_at,
        finished_at: None,
        lease_until: None,
    }
}

#[test]
fn a_line_is_given_up_only_when_no_call_can_answer_it_any_more() {
    let late = Duration::from_secs(600);
    let now = 1_000_000_000;
    let dead = attempt(AttemptState::Unknown, Some(LEASE_EXPIRED), now);
    let timed_out = attempt(AttemptState::Unknown, Some("timeout"), now - 60_000);
    let past_window = attempt(AttemptState::Unknown, Some("timeout"), now - 600_000);
    let running = attempt(AttemptState::Running, None, now);
    // Its process died, or its late window passed: nothing will end it.
    assert!(held_for_good(std::slice::from_ref(&dead), late, now));
    assert!(held_for_good(std::slice::from_ref(&past_window), late, now));
    // Its call still listens for a late answer, or another attempt runs.
    assert!(!held_for_good(std::slice::from_ref(&timed_out), late, now));
    assert!(!held_for_good(&[dead, running.clone()], late, now));
    assert!(!held_for_good(&[running], late, now));
    assert!(!held_for_good(&[], late, now));
}
