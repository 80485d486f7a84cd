// llama_logits: evaluate token ids with llama.cpp and write the logits of every position.
//
// Usage: llama_logits MODEL.gguf OUT.bin [--kv f16|f32] [--threads N] ID [ID ...]
// Writes n_tokens x n_vocab float32 (row-major, position by position) to OUT.bin and prints
// "n_tokens n_vocab" on stdout. One sequence, one llama_decode call, every position an output; the KV cache type
// (default f32, so that the comparison sees the weights and the kernels rather than cache rounding) is a flag.
// Build: see the docstring of benchmarks/export_gguf.py (links against llama.cpp's libllama only).
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin [--kv f16|f32] [--threads N] ID [ID ...]\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const char * out_path = argv[2];
    ggml_type kv = GGML_TYPE_F32;
    int threads = 2;
    std::vector<llama_token> ids;
    for (int i = 3; i < argc; ++i) {
        if (!strcmp(argv[i], "--kv") && i + 1 < argc) {
            kv = !strcmp(argv[++i], "f16") ? GGML_TYPE_F16 : GGML_TYPE_F32;
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else {
            ids.push_back((llama_token) atoi(argv[i]));
        }
    }
    if (!getenv("LLAMA_LOGITS_VERBOSE")) {
        llama_log_set([](ggml_log_level level, const char * text, void *) {
            if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
        }, nullptr);
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", model_path); return 1; }

    const int n = (int) ids.size();
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n < 64 ? 64 : n;
    cp.n_batch = cp.n_ubatch = cp.n_ctx;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.type_k = cp.type_v = kv;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(out_path, "wb");
    if (!f) { fprintf(stderr, "cannot write %s\n", out_path); return 1; }
    for (int i = 0; i < n; ++i) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    printf("%d %d\n", n, n_vocab);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
