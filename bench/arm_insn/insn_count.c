/* A qemu-user plugin that counts the AArch64 instructions a guest executes inside a window it
   opens and closes itself, in all and for a few instruction kinds told apart by their encoding
   (Arm ARM, "Advanced SIMD three different" and "three same (extra)" groups):
     sdot, udot        FEAT_DotProd int8 dot products (vector and by-element forms)
     widening_mul      SMULL/UMULL/SMLAL/UMLAL (vector): the int8 path of cores without sdot
   The guest opens a window with syscall(PRIMA_WINDOW, 1) and closes it with
   syscall(PRIMA_WINDOW, 0); the kernel never sees the call (an unused number: the guest gets
   ENOSYS). Closing writes "<kind> <count>" lines, one set per window, to out=FILE (else qemu's
   log). Counters are plain adds, exact with one guest thread (NUMBA_NUM_THREADS=1).
   Build: gcc -O2 -shared -fPIC -fvisibility=hidden -o libinsn_count.so insn_count.c
   Use:   qemu-aarch64 -cpu cortex-a76 -plugin ./libinsn_count.so,out=counts.txt PROGRAM */
#include "qemu_plugin_api.h"

#include <stdio.h>
#include <string.h>

#define PRIMA_WINDOW 4095

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

enum kind { ALL, SDOT, UDOT, WIDENING_MUL, N_KINDS };
static const char *const kind_names[N_KINDS] = {"insns", "sdot", "udot", "widening_mul"};
static uint64_t counts[N_KINDS];
static uint64_t opened_at[N_KINDS];
static char out_path[1024];

/* The kind of one 32-bit instruction word, or -1 for none we count apart. */
static int kind_of(uint32_t w) {
    /* SDOT/UDOT (vector): 0 Q U 01110 10 0 Rm 100101 Rn Rd */
    if ((w & 0x9FE0FC00u) == 0x0E809400u) return (w >> 29) & 1 ? UDOT : SDOT;
    /* SDOT/UDOT (by element): 0 Q U 01111 10 L M Rm 1110 H 0 Rn Rd */
    if ((w & 0x9FC0F400u) == 0x0F80E000u) return (w >> 29) & 1 ? UDOT : SDOT;
    /* SMULL/UMULL (opcode 1100) and SMLAL/UMLAL (opcode 1000): 0 Q U 01110 size 1 Rm opcode 00 Rn Rd */
    if ((w & 0x9F200C00u) == 0x0E200000u) {
        uint32_t opcode = (w >> 12) & 0xF;
        if (opcode == 0xC || opcode == 0x8) return WIDENING_MUL;
    }
    return -1;
}

/* Called once per translated block: every execution of the block adds its length to ALL, and
   each counted instruction adds one to its kind. */
static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    size_t n = qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &counts[ALL], n);
    for (size_t i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint32_t w;
        if (qemu_plugin_insn_size(insn) != sizeof w) continue;
        memcpy(&w, qemu_plugin_insn_data(insn), sizeof w);
        int k = kind_of(w);
        if (k >= 0) qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[k], 1);
    }
}

static void report(const char *text) {
    FILE *f = out_path[0] ? fopen(out_path, "a") : NULL;
    if (!f) {
        qemu_plugin_outs(text);
        return;
    }
    fputs(text, f);
    fclose(f);
}

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu, int64_t num, uint64_t a1, uint64_t a2,
                       uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7, uint64_t a8) {
    if (num != PRIMA_WINDOW) return;
    if (a1 == 1) {
        memcpy(opened_at, counts, sizeof counts);
        return;
    }
    char text[512];
    size_t len = 0;
    for (int k = 0; k < N_KINDS; k++)
        len += snprintf(text + len, sizeof text - len, "%s %llu\n", kind_names[k],
                        (unsigned long long)(counts[k] - opened_at[k]));
    report(text);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                           char **argv) {
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "out=", 4) == 0) snprintf(out_path, sizeof out_path, "%s", argv[i] + 4);
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    return 0;
}
