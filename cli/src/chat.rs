//! `prism chat`: an interactive conversation. Each turn sends the whole history as
//! `ChatMessages` over gRPC (the model's chat template renders it) and streams the reply.
//! `/reset` clears the history, `/exit` or end of input quits. Input lines are read as
//! bytes and converted lossily (invalid UTF-8 becomes U+FFFD, the session goes on); the
//! `>>>` prompt is shown only when stdin is a terminal.

use crate::client::{self, ModelArg};
use crate::generate::{self, SamplingArgs};
use anyhow::Result;
use clap::Args;
use prism_common::proto::v1::{ChatMessage, ChatMessages, GenerateRequest, generate_request::Prompt};
use std::io::{IsTerminal, Write};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

/// `prism chat` flags.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// `--model`: the served model to chat with.
    #[command(flatten)]
    pub model: ModelArg,
    /// System message put before the conversation.
    #[arg(long, env = "PRISM_SYSTEM")]
    pub system: Option<String>,
    /// Print token counts and the finish reason after each reply.
    #[arg(long, short = 'v', env = "PRISM_VERBOSE")]
    pub verbose: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// `--api-key`: for a router that requires one.
    #[command(flatten)]
    pub key: client::KeyArg,
}

/// The next input line without its line ending, invalid UTF-8 replaced; `None` at end of input.
async fn next_line<R: AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    if r.read_until(b'\n', &mut buf).await? == 0 {
        return Ok(None);
    }
    Ok(Some(String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_owned()))
}

fn initial_history(system: Option<&str>) -> Vec<ChatMessage> {
    system
        .map(|s| ChatMessage { role: "system".into(), content: s.to_owned(), ..Default::default() })
        .into_iter()
        .collect()
}

/// Runs the interactive loop until `/exit` or end of input.
///
/// # Errors
/// Fails when the router is unreachable or stdin/stdout fail; a rejected turn is
/// reported and the conversation continues without it.
pub async fn run(router: &client::RouterTarget, args: ChatArgs) -> Result<()> {
    let mut client = client::router(router).await?;
    let model = args.model.resolve(&mut client, &args.key).await?;
    let mut history = initial_history(args.system.as_deref());
    let interactive = std::io::stdin().is_terminal();
    let mut input = BufReader::new(tokio::io::stdin());
    let mut stdout = std::io::stdout();
    eprintln!("Chatting with {model}. /reset clears the history, /exit quits.");
    loop {
        if interactive {
            write!(stdout, ">>> ")?;
            stdout.flush()?;
        }
        let Some(line) = next_line(&mut input).await? else {
            if interactive {
                writeln!(stdout)?;
            }
            return Ok(());
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                history = initial_history(args.system.as_deref());
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage { role: "user".into(), content: line.to_owned(), ..Default::default() });
        let request = GenerateRequest {
            model: model.clone(),
            prompt: Some(Prompt::Chat(ChatMessages { messages: history.clone() })),
            sampling: Some(args.sampling.to_proto()),
            ..GenerateRequest::default()
        };
        match generate::stream(&mut client, args.key.request(request)?, &mut stdout).await {
            Ok(reply) => {
                writeln!(stdout)?;
                if args.verbose {
                    generate::print_summary(&reply);
                }
                history.push(ChatMessage { role: "assistant".into(), content: reply.text, ..Default::default() });
            }
            Err(e) => {
                writeln!(stdout)?;
                eprintln!("error: {e:#}");
                history.pop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn invalid_utf8_lines_are_kept_lossily() {
        let data: &[u8] = b"hi \xff\xfe there\r\nnext\nlast";
        let mut r = BufReader::new(data);
        assert_eq!(next_line(&mut r).await.ok().flatten().as_deref(), Some("hi \u{fffd}\u{fffd} there"));
        assert_eq!(next_line(&mut r).await.ok().flatten().as_deref(), Some("next"));
        assert_eq!(next_line(&mut r).await.ok().flatten().as_deref(), Some("last"));
        assert_eq!(next_line(&mut r).await.ok().flatten(), None);
    }
}
