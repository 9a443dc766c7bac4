//! The tree has no import circles: in every crate of the workspace, no file reaches (through
//! `crate::` paths, directly or not) a file that reaches it back, and no room (a top-level
//! module and everything under it) reaches a room that reaches it back. A file's children
//! (`mod x;` in it) are not imports; test modules (`#[cfg(test)]` to the end of the file) and
//! comments are not read.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module path of each `.rs` file under `src` (`a::b` for `src/a/b.rs` or `src/a/b/mod.rs`;
/// the crate root is the empty path).
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src).unwrap().with_extension("");
                let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    parts.pop();
                }
                if parts.first().is_some_and(|p| p == "bin") {
                    continue;
                }
                out.insert(parts.join("::"), p);
            }
        }
    }
    out
}

/// The code of a file without its comments and its test module.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

fn ident(s: &str) -> usize {
    s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len())
}

/// Every path `crate::...` names in `s` (groups `crate::{a, b::{c, d}}` expanded), each as
/// its segments.
fn paths(s: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        out.extend(path_at(rest, Vec::new()));
    }
    out
}

/// The paths that start at `s`, below `prefix`.
fn path_at(s: &str, mut prefix: Vec<String>) -> Vec<Vec<String>> {
    let s = s.trim_start();
    if let Some(inner) = s.strip_prefix('{') {
        // A group: split at top-level commas up to the matching brace.
        let (mut depth, mut start, mut out) = (0usize, 0usize, Vec::new());
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.extend(path_at(&inner[start..i], prefix.clone()));
                    return out;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.extend(path_at(&inner[start..i], prefix.clone()));
                    start = i + 1;
                }
                _ => {}
            }
        }
        return out;
    }
    let n = ident(s);
    if n == 0 {
        return vec![prefix];
    }
    prefix.push(s[..n].to_string());
    match s[n..].trim_start().strip_prefix("::") {
        Some(more) => path_at(more, prefix),
        None => vec![prefix],
    }
}

/// The longest module a path names (`a::b::Item` -> `a::b`).
fn module_of(mods: &BTreeMap<String, PathBuf>, path: &[String]) -> Option<String> {
    (1..=path.len()).rev().map(|n| path[..n].join("::")).find(|m| mods.contains_key(m))
}

/// Strongly connected components with more than one member (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w.as_str()) {
                visit(t, w);
                let lw = t.low[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w.as_str()) {
                let iw = t.index[w.as_str()];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                c.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                c.sort();
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// Circles between the files and between the rooms of the crate whose sources are `src`.
fn circles_in(src: &Path) -> Vec<String> {
    let mods = modules(src);
    let mut files: BTreeMap<String, BTreeSet<String>> = mods.keys().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (me, path) in &mods {
        for p in paths(&code(path)) {
            if let Some(to) = module_of(&mods, &p)
                && to != *me
                && !me.starts_with(&format!("{to}::"))
                && !to.is_empty()
            {
                files.get_mut(me).unwrap().insert(to);
            }
        }
    }
    let room = |m: &str| m.split("::").next().unwrap_or_default().to_string();
    let mut rooms: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, tos) in &files {
        let e = rooms.entry(room(from)).or_default();
        e.extend(tos.iter().map(|t| room(t)).filter(|t| *t != room(from)));
    }
    let mut out: Vec<String> = circles(&files).into_iter().map(|c| format!("files {}", c.join(" <-> "))).collect();
    out.extend(circles(&rooms).into_iter().map(|c| format!("rooms {}", c.join(" <-> "))));
    out
}

#[test]
fn the_parser_sees_groups_and_nested_paths() {
    let got = paths("use crate::{a, b::{c, d::E}};\nlet x = crate::f::g(1); kvcrate::h;");
    let want: Vec<Vec<String>> = [vec!["a"], vec!["b", "c"], vec!["b", "d", "E"], vec!["f", "g"]]
        .iter()
        .map(|v| v.iter().map(|s| s.to_string()).collect())
        .collect();
    assert_eq!(got, want);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
}

#[test]
fn no_crate_in_the_workspace_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = Vec::new();
    let mut crates = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if d != root && (name.starts_with('.') || name == "target" || name == "node_modules") {
            continue;
        }
        if d.join("Cargo.toml").is_file() && d.join("src").is_dir() {
            crates += 1;
            found.extend(circles_in(&d.join("src")).into_iter().map(|c| format!("{}: {c}", d.display())));
        }
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(e.path());
            }
        }
    }
    assert!(crates >= 8, "found only {crates} crates under {}", root.display());
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}
