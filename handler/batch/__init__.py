"""`scorefn batch`: OpenAI batch files (one request per JSONL line) scored through the same core as HTTP.

The batch job is a third face of handler.core beside ASGI and WSGI: in process (the engine loaded in the job, lines
coalesced into device rounds as concurrent requests are) or against a running server (`--url`). It lives in
handler/ because it drives the core; runtime/'s CLI starts it by module name (`python -m handler.batch`), as it
starts the served apps, so no import runs from runtime/ into handler/.

    lines     the input file: parse each line, the custom_ids up front, the items a line asks for
    records   the output file: OpenAI's output records, resumed after a crash (a torn last line is redone)
    shards    which lines a shard takes (--shard, Cloud Run Jobs' and Indexed Jobs' environment)
    local     answers in process; remote: answers from a server (retries, Retry-After)
    job       the loop: a window of lines in flight, written in input order, SIGTERM finishing the window
    progress  a bar on a terminal, JSON lines otherwise, a closing summary
    merge     shards' files into one in input order, naming what is missing
"""
