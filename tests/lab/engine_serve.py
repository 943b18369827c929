"""engine_serve.py — the real tiny engine the tests and `make run` start: llama.cpp's own
server (llama-server: slots, prompt cache, /health, /metrics, timings.cache_n) from the
prebuilt `xllamacpp` wheel, on one loopback port, until SIGTERM or SIGINT.

It takes llama-server's flags (the subset otela uses), so the command reads like the
`llama-server -m M --alias A --port {port}` of sbatch/llamacpp.sbatch. xllamacpp has no
`python -m` server entry of its own: its `Server(params)` starts the HTTP server in a thread
of this process, so this file only fills the params and waits for a signal.

Where no xllamacpp wheel exists for the platform (or Python < 3.10), engine_install.sh
builds llama-cpp-python from source instead, and this file hands the same flags to
`python -m llama_cpp.server` (which has no /health: readiness is GET /v1/models).

  python engine_serve.py -m MODEL.gguf --alias smollm2-135m --port 18000 [--host 127.0.0.1]
                         [-c CTX] [-t THREADS] [-np PARALLEL]
  python engine_serve.py --check -m MODEL.gguf   # generate 4 tokens in-process, exit 0 if it can
"""
import argparse
import os
import signal
import sys
import threading


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the GGUF file")
    p.add_argument("-a", "--alias", default="", help="the model name clients ask for")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18000)
    # 2 slots of 2048 tokens: a stream and a health check or a second user are served at
    # once (a 135M model's KV cache for both is ~90 MB).
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context of all slots together")
    p.add_argument("-np", "--parallel", type=int, default=2, help="slots (concurrent requests)")
    # One thread: ~70 tokens/s for SmolLM2-135M, and a 2-core test machine stays usable.
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--check", action="store_true",
                   help="generate a few tokens in-process and exit (an install's smoke test)")
    return p.parse_args(argv)


def params(args):
    import xllamacpp
    cp = xllamacpp.CommonParams()
    cp.model.path = args.model
    if args.alias:
        cp.model_alias = {args.alias}
    cp.hostnames = [args.host]
    cp.port = args.port
    cp.n_ctx = args.ctx_size
    cp.n_parallel = args.parallel
    cp.cpuparams.n_threads = args.threads
    cp.cpuparams_batch.n_threads = args.threads
    cp.endpoint_metrics = True
    return xllamacpp, cp


def check(args):
    """A prebuilt wheel can still die with SIGILL at the first token on a CPU that advertises
    instructions it then refuses (AVX-512/AMX in some sandboxes): generate before trusting it."""
    xllamacpp, cp = params(args)
    cp.port = 0
    server = xllamacpp.Server(cp)
    answer = server.handle_completions({"prompt": "Once upon a time", "max_tokens": 4})
    tokens = answer.get("usage", {}).get("completion_tokens", 0) if isinstance(answer, dict) else 0
    print(f"engine check: {tokens} tokens generated")
    return 0 if tokens > 0 else 1


def serve_llama_cpp_python(args):
    """The fallback engine (source-built llama-cpp-python) with the same flags. Without
    --interrupt_requests False it ends a stream whenever another request arrives."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", args.model, "--host", args.host,
            "--port", str(args.port), "--n_ctx", str(args.ctx_size), "--n_threads", str(args.threads),
            "--verbose", "False", "--interrupt_requests", "False"]
    if args.alias:
        argv += ["--model_alias", args.alias]
    os.execv(sys.executable, argv)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        if args.check:
            import llama_cpp  # noqa: F401  (the fallback is installed: nothing more to check here)
            return 0
        serve_llama_cpp_python(args)
    if args.check:
        return check(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    xllamacpp, cp = params(args)
    server = xllamacpp.Server(cp)   # returns once the model is loaded and the port is bound
    print(f"engine: serving {args.alias or args.model} on {server.listening_address}", flush=True)
    stop.wait()
    del server                      # stops the HTTP thread and frees the model before exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
