//! Parses the sympy expressions torch.export writes for symbolic sizes into `Dim`s. Torch
//! releases differ: some write `str()` forms (`s0`, `2*s0 + 1`, `FloorDiv(s0, 2)`), newer ones
//! `srepr()` forms (`Symbol('s0', positive=True, integer=True)`, `Add(Integer(1), ...)`).

use crate::dim::{Dim, DimOp};
use crate::error::{Error, Result};

pub fn parse(src: &str) -> Result<Dim> {
    let tokens = tokenize(src)?;
    let mut p = Parser {
        toks: &tokens,
        pos: 0,
        src,
    };
    let d = p.expr()?;
    if p.pos != tokens.len() {
        return Err(p.err());
    }
    Ok(d)
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Int(i64),
    Name(String),
    /// A quoted string (a symbol's name in srepr form).
    Str(String),
    Op(&'static str),
}

fn tokenize(src: &str) -> Result<Vec<Tok>> {
    let mut out = Vec::new();
    let chars: Vec<char> = src.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            let s: String = chars[start..i].iter().collect();
            out.push(Tok::Int(s.parse().map_err(|_| bad(src))?));
        } else if c == '\'' || c == '"' {
            let start = i + 1;
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += 1;
            }
            if i >= chars.len() {
                return Err(bad(src));
            }
            out.push(Tok::Str(chars[start..i].iter().collect()));
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Tok::Name(chars[start..i].iter().collect()));
        } else {
            let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            let op = match (c, two.as_str()) {
                (_, "//") => "//",
                (_, "**") => "**",
                ('+', _) => "+",
                ('-', _) => "-",
                ('*', _) => "*",
                ('%', _) => "%",
                ('(', _) => "(",
                (')', _) => ")",
                (',', _) => ",",
                ('=', _) => "=",
                _ => return Err(bad(src)),
            };
            i += op.len();
            out.push(Tok::Op(op));
        }
    }
    Ok(out)
}

fn bad(src: &str) -> Error {
    Error::Compile(format!("unsupported symbolic size expression '{src}'"))
}

struct Parser<'a> {
    toks: &'a [Tok],
    pos: usize,
    src: &'a str,
}

impl Parser<'_> {
    fn err(&self) -> Error {
        bad(self.src)
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn eat(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Op(o)) if *o == op) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expr(&mut self) -> Result<Dim> {
        let mut d = self.term()?;
        loop {
            if self.eat("+") {
                d = Dim::binary(DimOp::Add, d, self.term()?);
            } else if self.eat("-") {
                d = Dim::binary(DimOp::Sub, d, self.term()?);
            } else {
                return Ok(d);
            }
        }
    }

    fn term(&mut self) -> Result<Dim> {
        let mut d = self.factor()?;
        loop {
            if self.eat("*") {
                d = Dim::binary(DimOp::Mul, d, self.factor()?);
            } else if self.eat("//") {
                d = Dim::binary(DimOp::FloorDiv, d, self.factor()?);
            } else if self.eat("%") {
                d = Dim::binary(DimOp::Mod, d, self.factor()?);
            } else {
                return Ok(d);
            }
        }
    }

    fn factor(&mut self) -> Result<Dim> {
        if self.eat("-") {
            let f = self.factor()?;
            return Ok(Dim::binary(DimOp::Sub, Dim::Const(0), f));
        }
        if self.eat("(") {
            let d = self.expr()?;
            if !self.eat(")") {
                return Err(self.err());
            }
            return Ok(d);
        }
        match self.peek().cloned() {
            Some(Tok::Int(v)) => {
                self.pos += 1;
                Ok(Dim::Const(v))
            }
            Some(Tok::Name(n)) => {
                self.pos += 1;
                if !self.eat("(") {
                    return Ok(Dim::sym(&n));
                }
                self.call(&n)
            }
            _ => Err(self.err()),
        }
    }

    /// A function call after its `(`: sympy constructors and torch's integer functions.
    fn call(&mut self, name: &str) -> Result<Dim> {
        if name == "Symbol" {
            let Some(Tok::Str(sym)) = self.peek().cloned() else {
                return Err(self.err());
            };
            self.pos += 1;
            self.skip_keywords()?;
            return Ok(Dim::sym(&sym));
        }
        let mut args = vec![self.expr()?];
        while self.eat(",") {
            if self.is_keyword() {
                break;
            }
            args.push(self.expr()?);
        }
        self.skip_keywords()?;
        let op = match name {
            "Integer" if args.len() == 1 => return Ok(args.remove(0)),
            "Add" => DimOp::Add,
            "Mul" => DimOp::Mul,
            "FloorDiv" => DimOp::FloorDiv,
            "Mod" | "PythonMod" => DimOp::Mod,
            "Max" => DimOp::Max,
            "Min" => DimOp::Min,
            _ => return Err(self.err()),
        };
        let mut it = args.into_iter();
        let first = it.next().ok_or_else(|| self.err())?;
        Ok(it.fold(first, |acc, d| Dim::binary(op, acc, d)))
    }

    fn is_keyword(&self) -> bool {
        matches!(
            (self.toks.get(self.pos), self.toks.get(self.pos + 1)),
            (Some(Tok::Name(_)), Some(Tok::Op("=")))
        )
    }

    /// Skips `, key=value` arguments (sympy assumptions such as `integer=True`) and the `)`.
    fn skip_keywords(&mut self) -> Result<()> {
        loop {
            if self.eat(")") {
                return Ok(());
            }
            self.eat(",");
            if self.is_keyword() {
                self.pos += 2;
                self.factor()?;
            } else {
                return Err(self.err());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dim::SymbolBindings;
    use std::sync::Arc;

    #[test]
    fn parses_sympy_sizes() {
        let mut env = SymbolBindings::new();
        env.insert(Arc::from("s0"), 7);
        env.insert(Arc::from("s1"), 3);
        for (src, want) in [
            ("s0", 7),
            ("2*s0 + 1", 15),
            ("s0*s1", 21),
            ("FloorDiv(s0, 2)", 3),
            ("Max(1, s1 - 5)", 1),
            ("(s0 + 1)//2", 4),
            ("-s1 + s0", 4),
        ] {
            assert_eq!(parse(src).unwrap().eval(&env).unwrap(), want, "{src}");
        }
        for (src, want) in [
            ("Symbol('s0', positive=True, integer=True)", 7),
            ("Add(Symbol('s0', integer=True), Integer(1))", 8),
            ("Mul(Integer(2), Symbol('s1', integer=True))", 6),
            ("FloorDiv(Symbol('s0'), Integer(2))", 3),
            ("Max(Integer(1), Symbol('s1'))", 3),
        ] {
            assert_eq!(parse(src).unwrap().eval(&env).unwrap(), want, "{src}");
        }
        assert!(parse("Symbol(3)").is_err());
        assert!(parse("Add(Symbol('s0'), ").is_err());
        assert!(parse("s0 ^ 2").is_err());
        assert!(parse("Foo(s0)").is_err());
    }
}
