//! The docs cannot rot: every ```toml block of README.md and docs/*.md is
//! checked the way `idem check` checks a configuration file
//! (`cargo test --test docs`).
//!
//! How a block is checked depends on the line just before its fence:
//!
//! - nothing special: the block is a **whole configuration**. It is parsed
//!   and validated as a file `idem.toml` at the repository's root
//!   ([`Config::from_toml_str`] with `Source::File`, without environment
//!   overrides), so a relative `contract` path names a file of the
//!   repository (`examples/contracts/support.toml`); then every route's
//!   contract is loaded, as `idem check` does.
//! - `<!-- check: fragment -->`: a **piece of a configuration** (a
//!   `[routes.cache]` table, a `[coalescing]` section, ...). It is appended
//!   to [`WRAPPER`], a configuration of one mock provider
//!   (`fragment-mock`) and one route (`fragment-route`), and the whole is
//!   checked as above. So a fragment may hold top-level tables that the
//!   wrapper does not (`[server]`, `[coalescing]`, ...), more
//!   `[[tenants]]`, `[[providers]]` or `[[routes]]` (whose targets may use
//!   `fragment-mock`), a route's own tables (`[routes.cache]`,
//!   `[routes.coalesce]`, `[routes.attempts]`) or bare route keys: the
//!   latter two apply to the wrapper's route.
//! - `<!-- check: contract -->`: a **contract file**, loaded with
//!   [`Contract::load`] as a file of `examples/contracts/` (it is written
//!   into a copy of that folder, so `schema = "support_reply.schema.json"`
//!   resolves).
//! - `<!-- check: skip REASON -->`: not checked; the reason is required.
//!
//! Any other `<!-- check: ... -->`, or one that is not followed by a
//! ```toml fence, fails the test, so that a typo cannot skip a block.
//!
//! And the table of docs/http-api.md, "What becomes of each field", cannot
//! cite a test that is gone: every row of its tables (those whose last
//! column is `test`) cites at least one, as `module::path::test_name`
//! (a path under `src/`, or `tests/` for a test target) with an optional
//! `#case` label, or `#case` alone for another case of the test cited
//! before it in the cell; the file of the path must hold `fn test_name`,
//! its inline modules (`mod tests`) and the label as a string literal.
//!
//! This is a test target of its own, not a unit test in `src/config`: it
//! reads files outside `src/`, needs no database or Redis, and uses only
//! the public entry points `idem check` uses.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::path::{Path, PathBuf};

use idem::config::{Config, Source};
use idem::contracts::Contract;

/// What a fragment is appended to.
const WRAPPER: &str = r#"[[providers]]
name = "fragment-mock"
kind = "mock"

[[routes]]
model = "fragment-route"
targets = [{ provider = "fragment-mock", model = "mock-1" }]
"#;

/// How the markdown says to check a block.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Whole,
    Fragment,
    Contract,
    Skip(String),
}

/// One ```toml block: where it is, how to check it, its text.
#[derive(Debug)]
struct Block {
    /// `README.md:42`: the file (relative to the repository) and the
    /// line of the opening fence.
    at: String,
    kind: Kind,
    text: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every docs/*.md, relative to the repository, sorted.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The `<!-- check: ... -->` marker on `line`, if it is one.
fn marker(line: &str) -> Option<Result<Kind, String>> {
    let inner = line
        .trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim()
        .strip_prefix("check:")?
        .trim();
    Some(if inner == "fragment" {
        Ok(Kind::Fragment)
    } else if inner == "contract" {
        Ok(Kind::Contract)
    } else if inner == "skip" {
        Err("`check: skip` needs a reason".to_string())
    } else if let Some(reason) = inner.strip_prefix("skip ") {
        Ok(Kind::Skip(reason.trim().to_string()))
    } else {
        Err(format!(
            "unknown marker `check: {inner}` (fragment, contract or skip REASON)"
        ))
    })
}

/// Every ```toml block of `markdown`; `name` is the file's name in
/// messages. Errors: bad or stray markers, unclosed fences.
fn toml_blocks(name: &str, markdown: &str) -> (Vec<Block>, Vec<String>) {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut blocks = Vec::new();
    let mut errors = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            let indent = line.len() - trimmed.len();
            let start = i;
            let mut end = i + 1;
            while end < lines.len() && lines[end].trim() != "```" {
                end += 1;
            }
            if end == lines.len() {
                errors.push(format!("{name}:{}: unclosed fence", start + 1));
                break;
            }
            if info.trim().eq_ignore_ascii_case("toml") {
                let at = format!("{name}:{}", start + 1);
                let kind = match start.checked_sub(1).and_then(|p| marker(lines[p])) {
                    None => Kind::Whole,
                    Some(Ok(kind)) => kind,
                    Some(Err(e)) => {
                        errors.push(format!("{name}:{start}: {e}"));
                        Kind::Whole
                    }
                };
                let text = lines[start + 1..end]
                    .iter()
                    .map(|l| l.get(indent..).unwrap_or(l.trim_start()))
                    .collect::<Vec<_>>()
                    .join("\n");
                blocks.push(Block { at, kind, text });
            }
            i = end + 1;
            continue;
        }
        if marker(line).is_some() {
            let next_is_toml = lines
                .get(i + 1)
                .is_some_and(|n| n.trim_start().eq_ignore_ascii_case("```toml"));
            if !next_is_toml {
                errors.push(format!(
                    "{name}:{}: a check marker must be the line just before a ```toml fence",
                    i + 1
                ));
            }
        }
        i += 1;
    }
    (blocks, errors)
}

/// Where a block is taken to be: a configuration file at the repository's
/// root, so that relative contract paths name the repository's files.
fn as_file() -> PathBuf {
    root().join("idem.toml")
}

/// Checks a configuration as `idem check` does, as if it were [`as_file`].
fn check_config(text: &str) -> Result<(), String> {
    let config =
        Config::from_toml_str(text, Source::File(as_file()), false).map_err(|e| e.to_string())?;
    idem::contracts::load_all(&config).map_err(|e| e.to_string())?;
    Ok(())
}

/// Loads a contract as a file of a copy of `examples/contracts/`.
fn check_contract(at: &str, text: &str) -> Result<(), String> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "docs-contract-{}-{}",
        std::process::id(),
        at.replace(['/', ':', '.'], "-")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for entry in std::fs::read_dir(root().join("examples/contracts")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let file = dir.join("from-the-docs.toml");
    std::fs::write(&file, text).unwrap();
    let result = Contract::load(&file).map(|_| ()).map_err(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn check(block: &Block) -> Result<(), String> {
    match &block.kind {
        Kind::Whole => check_config(&block.text),
        Kind::Fragment => check_config(&format!("{WRAPPER}\n{}\n", block.text)),
        Kind::Contract => check_contract(&block.at, &block.text),
        Kind::Skip(_) => Ok(()),
    }
}

#[test]
fn every_toml_block_in_the_readme_and_the_docs_is_valid() {
    let mut failures = Vec::new();
    let mut checked = std::collections::BTreeMap::<String, usize>::new();
    for name in markdown_files() {
        let markdown = std::fs::read_to_string(root().join(&name)).unwrap();
        let (blocks, errors) = toml_blocks(&name, &markdown);
        failures.extend(errors);
        for block in &blocks {
            if let Err(e) = check(block) {
                // Config errors start with the file they were taken for.
                let file = format!("{}: ", as_file().display());
                let e = e.strip_prefix(&file).unwrap_or(&e);
                failures.push(format!("{} ({:?}): {e}", block.at, block.kind));
            }
            if !matches!(block.kind, Kind::Skip(_)) {
                *checked.entry(name.clone()).or_default() += 1;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} TOML block(s) in the docs are broken:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The extraction itself must keep finding the blocks that matter.
    for name in ["README.md", "docs/configuration.md", "docs/contracts.md"] {
        assert!(
            checked.get(name).is_some_and(|n| *n > 0),
            "no ```toml block found in {name}: {checked:?}"
        );
    }
}

#[test]
fn markers_are_read_and_a_typo_is_an_error() {
    let md = "text\n<!-- check: fragment -->\n```toml\n[routes.cache]\nttl = \"60s\"\n```\n\
              <!-- check: skip an example of a file that is not a config -->\n```toml\nx = 1\n```\n\
              <!-- check: fragmnet -->\n```toml\n```\n\
              <!-- check: skip -->\n```toml\n```\n\
              - a list item:\n\n  ```toml\n  [server]\n  listen = \"127.0.0.1:1\"\n  ```\n\
              <!-- check: contract -->\n\nnot a fence\n";
    let (blocks, errors) = toml_blocks("t.md", md);
    let kinds: Vec<&Kind> = blocks.iter().map(|b| &b.kind).collect();
    assert_eq!(
        kinds,
        [
            &Kind::Fragment,
            &Kind::Skip("an example of a file that is not a config".into()),
            &Kind::Whole,
            &Kind::Whole,
            &Kind::Whole,
        ]
    );
    assert_eq!(blocks[0].at, "t.md:3");
    assert_eq!(blocks[4].text, "[server]\nlisten = \"127.0.0.1:1\"");
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors[0].contains("fragmnet"), "{errors:?}");
    assert!(errors[1].contains("needs a reason"), "{errors:?}");
    assert!(errors[2].contains("just before"), "{errors:?}");
}

#[test]
fn a_broken_block_of_each_kind_fails() {
    let block = |kind: Kind, text: &str| Block {
        at: "t.md:1".into(),
        kind,
        text: text.into(),
    };
    let broken = [
        // A typo in a key.
        block(Kind::Whole, "[server]\nlisen = \"127.0.0.1:1\"\n"),
        // An inline table across lines is not TOML.
        block(
            Kind::Whole,
            "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\n\
             targets = [{ provider = \"p\",\n model = \"x\" }]\n",
        ),
        // An unknown provider.
        block(
            Kind::Whole,
            "[[routes]]\nmodel = \"m\"\ntargets = [{ provider = \"nobody\", model = \"x\" }]\n",
        ),
        // A key too short to be an API key.
        block(Kind::Whole, "[admin]\napi_keys = [\"...\"]\n"),
        // A contract file that does not exist.
        block(Kind::Fragment, "contract = \"contracts/nowhere.toml\"\n"),
        // A route table's value out of range.
        block(Kind::Fragment, "[routes.cache]\nttl = \"0s\"\n"),
        // A contract without cases.
        block(Kind::Contract, "required = [\"answer\"]\n"),
    ];
    for b in &broken {
        assert!(check(b).is_err(), "accepted: {:?}", b.text);
    }
    let good = [
        block(Kind::Whole, WRAPPER),
        block(
            Kind::Fragment,
            "contract = \"examples/contracts/support.toml\"\n[routes.cache]\nttl = \"60s\"\n",
        ),
        block(
            Kind::Contract,
            &std::fs::read_to_string(root().join("examples/contracts/support.toml")).unwrap(),
        ),
    ];
    for b in &good {
        assert_eq!(check(b), Ok(()), "{:?}", b.text);
    }
}

/// The section of docs/http-api.md whose tables cite their tests.
const FIELD_TABLE: &str = "### What becomes of each field";

/// The cells of a markdown table row (`| a | b |`).
fn cells(row: &str) -> Vec<&str> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(str::trim).collect()
}

/// The code spans of a cell.
fn code_spans(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The source file a module path names (`translate::table_tests`:
/// src/translate/table_tests/mod.rs; an integration test's first segment:
/// tests/NAME.rs), and the segments that are modules inside it.
fn module_file(root: &Path, modules: &[&str]) -> Option<(PathBuf, usize)> {
    for i in (1..=modules.len()).rev() {
        let dir = modules[..i].join("/");
        for file in [format!("src/{dir}.rs"), format!("src/{dir}/mod.rs")] {
            if root.join(&file).is_file() {
                return Some((root.join(file), i));
            }
        }
    }
    let test = root.join(format!("tests/{}.rs", modules.first()?));
    test.is_file().then_some((test, 1))
}

/// Whether the test `path` (`a::b::name`) and its case `label` exist in
/// the sources under `root`; the problem otherwise.
fn cited(root: &Path, path: &str, label: Option<&str>) -> Result<(), String> {
    let segments: Vec<&str> = path.split("::").collect();
    let Some((name, modules)) = segments.split_last() else {
        return Err(format!("`{path}` is no test path"));
    };
    let Some((file, used)) = module_file(root, modules) else {
        return Err(format!("`{path}`: no source file for its module"));
    };
    let text = std::fs::read_to_string(&file).unwrap();
    let file = file.strip_prefix(root).unwrap_or(&file).display();
    for inner in &modules[used..] {
        if !text.contains(&format!("mod {inner} ")) && !text.contains(&format!("mod {inner};")) {
            return Err(format!("`{path}`: no `mod {inner}` in {file}"));
        }
    }
    if !text.contains(&format!("fn {name}(")) {
        return Err(format!("`{path}`: no `fn {name}` in {file}"));
    }
    if let Some(label) = label
        && !text.contains(&format!("\"{label}\""))
    {
        return Err(format!("`{path}#{label}`: no case \"{label}\" in {file}"));
    }
    Ok(())
}

/// The citations of the field table in `markdown` (its section, up to the
/// next `## ` heading) checked against the sources under `root`: how many
/// there are, and the problems.
fn field_table_problems(root: &Path, markdown: &str) -> (usize, Vec<String>) {
    let mut problems = Vec::new();
    let Some(start) = markdown.find(FIELD_TABLE) else {
        return (0, vec![format!("no section {FIELD_TABLE:?}")]);
    };
    let section = &markdown[start..];
    let section = match section[1..].find("\n## ") {
        Some(end) => &section[..=end],
        None => section,
    };
    let mut citations = 0;
    let mut cites_tests = false;
    let mut previous_was_row = false;
    for line in section.lines() {
        let is_row = line.trim_start().starts_with('|');
        if !is_row {
            previous_was_row = false;
            continue;
        }
        let row = cells(line);
        if !previous_was_row {
            // A table's header.
            cites_tests = row.last() == Some(&"test");
            previous_was_row = true;
            continue;
        }
        if row
            .iter()
            .all(|c| c.chars().all(|ch| matches!(ch, '-' | ':')))
            || !cites_tests
        {
            continue;
        }
        let cell = row.last().copied().unwrap_or_default();
        let mut current: Option<&str> = None;
        let mut here = 0;
        for span in code_spans(cell) {
            let (path, label) = match span.split_once('#') {
                Some(("", label)) => match current {
                    Some(path) => (path, Some(label)),
                    None => {
                        problems.push(format!("`{span}` follows no test path: {line}"));
                        continue;
                    }
                },
                Some((path, label)) => (path, Some(label)),
                None => (span, None),
            };
            if !path.contains("::") {
                problems.push(format!("`{span}` is no test path: {line}"));
                continue;
            }
            current = Some(path);
            here += 1;
            if let Err(e) = cited(root, path, label) {
                problems.push(e);
            }
        }
        if here == 0 {
            problems.push(format!("a row cites no test: {line}"));
        }
        citations += here;
    }
    (citations, problems)
}

#[test]
fn every_test_the_field_table_cites_exists() {
    let markdown = std::fs::read_to_string(root().join("docs/http-api.md")).unwrap();
    let (citations, problems) = field_table_problems(&root(), &markdown);
    assert!(
        problems.is_empty(),
        "docs/http-api.md, {FIELD_TABLE:?}:\n{}",
        problems.join("\n")
    );
    assert!(citations > 100, "only {citations} citations found");
}

#[test]
fn a_vanished_test_or_case_in_the_field_table_is_an_error() {
    let md = format!(
        "{FIELD_TABLE}\n\n| field | gets | test |\n|---|---|---|\n\
         | a | x | `translate::table_tests::chat_messages::chat_to_anthropic#model`, `#system` |\n\
         | b | x | `translate::table_tests::no_such_test` |\n\
         | c | x | `translate::table_tests::chat_messages::chat_to_anthropic#no-such-case` |\n\
         | d | x | none |\n\
         | e | x | `#model` |\n\
         | f | x | `translate::nowhere::tests::t` |\n\n\
         | kind | speaks |\n|---|---|\n| `openai` | chat |\n\n## Next\n\n\
         | field | gets | test |\n|---|---|---|\n| g | x | nothing checked here |\n"
    );
    let (citations, problems) = field_table_problems(&root(), &md);
    // Rows a, b, c and f cite (a twice); the table without a test
    // column and the one past the section are not read.
    assert_eq!(citations, 5, "{problems:?}");
    let wanted = [
        "no `fn no_such_test`",
        "no case \"no-such-case\"",
        "a row cites no test: | d",
        "`#model` follows no test path",
        "a row cites no test: | e",
        "no `mod nowhere`",
    ];
    assert_eq!(problems.len(), wanted.len(), "{problems:#?}");
    for (problem, wanted) in problems.iter().zip(wanted) {
        assert!(problem.contains(wanted), "{problem:?} is not {wanted:?}");
    }
}
