//! Chat templates rendered as transformers' `apply_chat_template` renders them, behind a C ABI
//! for lib/chat (chat_template.hpp).
//!
//! The engine is minijinja: maintained, a full implementation of Jinja2's syntax (the language
//! of Hugging Face chat templates), and used to render chat templates in production (Hugging
//! Face's text-generation-inference and others); minijinja-contrib's pycompat supplies the
//! Python string and dict methods templates call. On top of it we provide what transformers'
//! sandbox provides: trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
//! `strftime_now`, a `tojson` that writes what Python's json.dumps writes, and the
//! `{% generation %}` tag, whose spans are returned with the text.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use std::fmt::Write as _;

// What a `{% generation %}` block's output is wrapped in: Unicode noncharacters, which never occur
// in text (a context that holds them is refused).
const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';

/// The template with every `{% generation %}` / `{% endgeneration %}` tag (with any whitespace
/// control, `{%-` `-%}` `{%+`) made a `call` block of `__lorarun_generation`, keeping the tag's
/// whitespace control and the line numbers.
fn rewrite_generation_tags(t: &str) -> String {
    let mut out = String::with_capacity(t.len() + 64);
    let mut rest = t;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let mut i = 2;
        let b = tag.as_bytes();
        let left = if i < b.len() && (b[i] == b'-' || b[i] == b'+') {
            i += 1;
            &tag[2..3]
        } else {
            ""
        };
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let word_start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        let word = &tag[word_start..i];
        let mut j = i;
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        let mut right = "";
        if j < b.len() && (b[j] == b'-' || b[j] == b'+') {
            right = &tag[j..j + 1];
            j += 1;
        }
        let closes = tag[j..].starts_with("%}");
        if closes && (word == "generation" || word == "endgeneration") {
            let body = if word == "generation" {
                "call __lorarun_generation()"
            } else {
                "endcall"
            };
            // Whitespace (and so newlines) inside the tag is kept, for the line numbers.
            let _ = write!(out, "{{%{} {}{}{}%}}", left, body, &tag[i..j - right.len()], right);
            rest = &tag[j + 2..];
        } else {
            out.push_str("{%");
            rest = &tag[2..];
        }
    }
    out.push_str(rest);
    out
}

fn generation(state: &mut State, kwargs: Kwargs) -> Result<Value, Error> {
    let caller: Value = kwargs.get("caller")?;
    kwargs.assert_all_used()?;
    let body = caller.call(state, &[])?;
    Ok(Value::from_safe_string(format!("{OPEN}{body}{CLOSE}")))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<Value, Error> {
    let cfmt = std::ffi::CString::new(format)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: the format holds a NUL"))?;
    let mut buf = vec![0u8; 512];
    // SAFETY: plain libc calls on owned buffers.
    let n = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&now, &mut tm);
        libc::strftime(buf.as_mut_ptr() as *mut libc::c_char, buf.len(), cfmt.as_ptr(), &tm)
    };
    buf.truncate(n);
    Ok(Value::from(String::from_utf8_lossy(&buf).into_owned()))
}

// ---- tojson: Python's json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys) ----

fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7f => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// Python's float repr (shortest round-trip digits, exponent past 1e16 or below 1e-4).
fn py_float(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        let a = f.abs();
        if a != 0.0 && !(1e-4..1e16).contains(&a) {
            let s = format!("{:e}", f); // e.g. 1e20, 1.5e-7
            let (m, e) = s.split_once('e').unwrap();
            let e: i32 = e.parse().unwrap();
            let _ = write!(out, "{}e{}{:02}", m, if e < 0 { '-' } else { '+' }, e.abs());
        } else {
            let s = format!("{:?}", f); // Rust's Debug always has a '.' or an exponent
            out.push_str(&s);
        }
    }
}

struct JsonStyle {
    indent: Option<String>,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn newline(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn to_json(v: &Value, style: &JsonStyle, level: usize, out: &mut String) -> Result<(), Error> {
    let item_sep = if style.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{}", i);
            } else if v.is_integer() {
                let _ = write!(out, "{}", v);
            } else {
                py_float(f64::try_from(v.clone()).unwrap_or(f64::NAN), out);
            }
        }
        ValueKind::String => json_string(v.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(item_sep);
                }
                newline(style, level + 1, out);
                to_json(item, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (k, key) in keys.iter().enumerate() {
                if k > 0 {
                    out.push_str(item_sep);
                }
                newline(style, level + 1, out);
                match key.as_str() {
                    Some(s) => json_string(s, style.ensure_ascii, out),
                    None => json_string(&key.to_string(), style.ensure_ascii, out),
                }
                out.push_str(": ");
                to_json(&v.get_item(key)?, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push('}');
        }
        _ => json_string(&v.to_string(), style.ensure_ascii, out),
    }
    Ok(())
}

fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) if i.as_str().is_some() => Some(i.as_str().unwrap().to_string()),
        Some(i) => Some(" ".repeat(i.as_usize().unwrap_or(0))),
    };
    let style = JsonStyle {
        indent,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    to_json(&v, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// "line N: what" for a render error, with raise_exception's message as it was given.
/// What a render that spent its fuel fails with.
const FUEL_SPENT: &str = "the render ran out of fuel";

fn describe(e: &Error) -> String {
    if e.kind() == ErrorKind::OutOfFuel {
        return FUEL_SPENT.to_string(); // a stable text the C++ side recognises
    }
    let what = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        (kind, Some(d)) => format!("{}: {}", kind, d),
        (kind, None) => kind.to_string(),
    };
    let mut s = match e.line() {
        Some(line) => format!("line {}: {}", line, what),
        None => what,
    };
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, " ({})", inner);
        src = inner.source();
    }
    s.replace('\n', " ")
}

/// The fuel of a first, quick try at a render (real chat templates spend far less): one that
/// needs more is rendered again with the whole fuel, where the caller can stop waiting for it.
const QUICK_FUEL: u64 = 1_000_000;

/// A template compiled once: the environment with transformers' additions (one allowed the whole
/// fuel, one the quick try's), and the rewritten source they borrow (owned here, freed after them).
pub struct Compiled {
    env: Environment<'static>,
    quick: Environment<'static>,
    source: *mut str,
}

impl Drop for Compiled {
    fn drop(&mut self) {
        self.env = Environment::empty();
        self.quick = Environment::empty();
        // SAFETY: `source` came from Box::into_raw in compile(), and nothing borrows it any more.
        unsafe { drop(Box::from_raw(self.source)) };
    }
}

fn compile(template: &str, fuel: u64) -> Result<Compiled, String> {
    if template.contains(OPEN) || template.contains(CLOSE) {
        return Err("the template holds U+FDD0 or U+FDD1, which mark generation spans".into());
    }
    let source: *mut str = Box::into_raw(rewrite_generation_tags(template).into_boxed_str());
    // SAFETY: `source` lives until Compiled is dropped, after the environments that borrow it.
    let text: &'static str = unsafe { &*source };
    let quick_fuel = if fuel == 0 { QUICK_FUEL } else { fuel.min(QUICK_FUEL) };
    let made = environment(text, fuel).and_then(|env| Ok((env, environment(text, quick_fuel)?)));
    match made {
        Ok((env, quick)) => Ok(Compiled { env, quick, source }),
        Err(e) => {
            // SAFETY: as in Drop: nothing borrows `source` once the environments are gone.
            unsafe { drop(Box::from_raw(source)) };
            Err(e)
        }
    }
}

/// The environment of `text`, each render of it allowed `fuel` (minijinja's unit: about one
/// instruction, or 64 bytes of data made; 0: unbounded).
fn environment(text: &'static str, fuel: u64) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_fuel(if fuel == 0 { None } else { Some(fuel) });
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_function("__lorarun_generation", generation);
    env.add_filter("tojson", tojson);
    env.add_template("chat", text).map_err(|e| describe(&e))?;
    Ok(env)
}

fn render(compiled: &Compiled, context_json: &str, quick: bool) -> Result<String, String> {
    if context_json.contains(OPEN) || context_json.contains(CLOSE) {
        return Err("the messages hold U+FDD0 or U+FDD1, which mark generation spans".into());
    }
    let context: serde_json::Value =
        serde_json::from_str(context_json).map_err(|e| format!("the context is not JSON: {}", e))?;
    let env = if quick { &compiled.quick } else { &compiled.env };
    let t = env.get_template("chat").map_err(|e| describe(&e))?;
    t.render(Value::from(minijinja::value::Serde(&context)))
        .map_err(|e| describe(&e))
}

/// Hands `text` to the caller as *out / *out_len (freed with lorarun_chat_free).
unsafe fn give(text: String, out: *mut *mut u8, out_len: *mut usize) {
    let mut bytes = text.into_bytes().into_boxed_slice();
    *out_len = bytes.len();
    *out = bytes.as_mut_ptr();
    std::mem::forget(bytes);
}

/// Compiles `template` (UTF-8, `template_len` bytes), each render of it allowed `fuel` (0: no
/// bound). Returns 0 and a handle in *handle (released with lorarun_chat_release), or 1 and a
/// one-line message ("line N: ...") in *error (freed with lorarun_chat_free).
///
/// # Safety
/// The pointers must be valid for the lengths given; the out-pointers must be writable.
#[no_mangle]
pub unsafe extern "C" fn lorarun_chat_compile(
    template: *const u8,
    template_len: usize,
    fuel: u64,
    handle: *mut *mut Compiled,
    error: *mut *mut u8,
    error_len: *mut usize,
) -> i32 {
    let t = std::slice::from_raw_parts(template, template_len);
    let result = match std::str::from_utf8(t) {
        Ok(t) => compile(t, fuel),
        Err(_) => Err("the template is not UTF-8".to_string()),
    };
    match result {
        Ok(c) => {
            *handle = Box::into_raw(Box::new(c));
            0
        }
        Err(e) => {
            give(e, error, error_len);
            1
        }
    }
}

/// Releases what lorarun_chat_compile made.
///
/// # Safety
/// `handle` must come from lorarun_chat_compile, released once.
#[no_mangle]
pub unsafe extern "C" fn lorarun_chat_release(handle: *mut Compiled) {
    if !handle.is_null() {
        drop(Box::from_raw(handle));
    }
}

/// Renders the compiled template with the variables of the JSON object `context`, allowed its
/// whole fuel, or with `quick` (not 0) at most the quick try's. Returns 0 and the text in *out
/// (generation spans between U+FDD0 and U+FDD1), or 1 and a one-line message ("line N: ...") in
/// *out. *out is freed with lorarun_chat_free. Several threads may render one handle at once.
///
/// # Safety
/// `handle` must be live; the pointers must be valid for the lengths given; `out` and `out_len`
/// must be writable.
#[no_mangle]
pub unsafe extern "C" fn lorarun_chat_render(
    handle: *const Compiled,
    context: *const u8,
    context_len: usize,
    quick: i32,
    out: *mut *mut u8,
    out_len: *mut usize,
) -> i32 {
    let c = std::slice::from_raw_parts(context, context_len);
    let result = match std::str::from_utf8(c) {
        Ok(c) => render(&*handle, c, quick != 0),
        Err(_) => Err("the context is not UTF-8".to_string()),
    };
    let (status, text) = match result {
        Ok(s) => (0, s),
        Err(e) => (1, e),
    };
    give(text, out, out_len);
    status
}

/// Frees what lorarun_chat_render or lorarun_chat_compile returned.
///
/// # Safety
/// `p` and `len` must be what one call of lorarun_chat_render wrote, freed once.
#[no_mangle]
pub unsafe extern "C" fn lorarun_chat_free(p: *mut u8, len: usize) {
    if !p.is_null() {
        drop(Box::from_raw(std::slice::from_raw_parts_mut(p, len)));
    }
}
