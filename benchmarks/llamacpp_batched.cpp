// Closed-loop batched greedy decoding with llama.cpp's library (libllama), for benchmarks/engine_throughput.py.
//
// The fallback for when llama.cpp's own llama-server binary is not built: the same engine llama-server runs
// (one llama_context, one sequence per slot, prompt tokens of newly admitted requests and the next token of
// running ones in the same llama_batch, a slot freed and refilled as soon as its request is done), minus HTTP.
//
// Build (against a llama.cpp CMake build with static libraries; LLAMA = its source dir, B = its build dir):
//   g++ -O2 -std=c++17 benchmarks/llamacpp_batched.cpp -I$LLAMA/include -I$LLAMA/ggml/include  (one command, continued:)
//       $B/src/libllama.a $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a
//       -fopenmp -lpthread -o llamacpp-batched
//
// Usage: llamacpp-batched MODEL.gguf THREADS CONCURRENCY CTX_PER_SLOT < requests
//   requests: one per line, "<max_tokens>\t<prompt text>". Output tokens are exactly max_tokens each
//   (greedy argmax, end-of-generation tokens not special: ignore_eos).
// Prints one JSON line: {"requests", "tokens", "seconds", "ttft_mean_s", "prompt_tokens"}; seconds from the
// first llama_decode to the last token, TTFT from a request's admission into a free slot to its first token
// (as the HTTP client's closed loop sends a request when one of its c finishes).

#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

struct Request {
    int max_tokens = 0;
    std::vector<llama_token> prompt;
    int generated = 0;
    double ttft = -1, admitted = 0;
    llama_token last = 0;
    int pos = 0;
};

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS CONCURRENCY CTX_PER_SLOT < requests\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]), conc = atoi(argv[3]), per_slot = atoi(argv[4]);
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.progress_callback = [](float, void *) { return true; };  // no loading dots on the output
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::vector<Request> reqs;
    std::string line;
    while (std::getline(std::cin, line)) {
        size_t tab = line.find('\t');
        if (tab == std::string::npos) continue;
        Request r;
        r.max_tokens = atoi(line.substr(0, tab).c_str());
        std::string text = line.substr(tab + 1);
        r.prompt.resize(text.size() + 8);
        int n = llama_tokenize(vocab, text.c_str(), (int) text.size(), r.prompt.data(), (int) r.prompt.size(), true, false);
        if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        r.prompt.resize(n);
        if (n + r.max_tokens > per_slot) { fprintf(stderr, "request longer than CTX_PER_SLOT\n"); return 1; }
        reqs.push_back(r);
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (conc * per_slot);
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = (uint32_t) conc;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.kv_unified = true;  // llama-server's default when its slot count is not forced per-slot
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    llama_memory_t mem = llama_get_memory(ctx);

    llama_batch batch = llama_batch_init(512, 0, 1);
    std::vector<int> slot(conc, -1);   // request index per slot
    std::vector<int> out_idx(conc, -1);  // this step's output row per slot
    size_t next = 0, done = 0, tokens = 0, prompt_tokens = 0;
    auto t0 = std::chrono::steady_clock::now();
    auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };

    while (done < reqs.size()) {
        batch.n_tokens = 0;
        auto add = [&](llama_token t, int pos, int seq, bool out) {
            int i = batch.n_tokens++;
            batch.token[i] = t; batch.pos[i] = pos; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = seq;
            batch.logits[i] = out;
            return i;
        };
        for (int s = 0; s < conc; ++s) {  // running requests: their next token
            out_idx[s] = -1;
            if (slot[s] >= 0) { Request & r = reqs[slot[s]]; out_idx[s] = add(r.last, r.pos++, s, true); }
        }
        for (int s = 0; s < conc && next < reqs.size(); ++s) {  // admit into free slots while the batch has room
            if (slot[s] >= 0) continue;
            Request & r = reqs[next];
            if (batch.n_tokens + (int) r.prompt.size() > 512) break;
            slot[s] = (int) next++;
            for (size_t k = 0; k < r.prompt.size(); ++k) out_idx[s] = add(r.prompt[k], (int) k, s, k + 1 == r.prompt.size());
            r.pos = (int) r.prompt.size();
            r.admitted = now();
            prompt_tokens += r.prompt.size();
        }
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        double t = now();
        for (int s = 0; s < conc; ++s) {
            if (slot[s] < 0 || out_idx[s] < 0) continue;
            Request & r = reqs[slot[s]];
            const float * lg = llama_get_logits_ith(ctx, out_idx[s]);
            int best = 0;
            for (int v = 1; v < n_vocab; ++v) if (lg[v] > lg[best]) best = v;
            r.last = best;
            if (r.generated++ == 0) r.ttft = t - r.admitted;
            ++tokens;
            if (r.generated == r.max_tokens) {
                llama_memory_seq_rm(mem, s, -1, -1);
                slot[s] = -1;
                ++done;
            }
        }
    }
    double secs = now(), ttft = 0;
    for (auto & r : reqs) ttft += r.ttft;
    printf("{\"requests\": %zu, \"tokens\": %zu, \"seconds\": %.6f, \"ttft_mean_s\": %.6f, \"prompt_tokens\": %zu}\n",
           reqs.size(), tokens, secs, reqs.empty() ? 0.0 : ttft / reqs.size(), prompt_tokens);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
