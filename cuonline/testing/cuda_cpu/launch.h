// launch.h: the glue between emulate.py and a kernel: the launch entry point, the signature
// codes that emulate.py checks the Python arguments against, and the last launch error.
#pragma once

#include "mode.h"
#include "fp16.h"

// ---------------------------------------------------------------------------------------------
// Launch glue, instantiated by the trampolines that emulate.py appends to the kernel text.
namespace cuemu {

template <class... A, size_t... I>
inline void invoke(void (*f)(A...), void** args, std::index_sequence<I...>) {
    // Each CUDA thread gets its own copy of the by-value parameters.
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// Signature code of one parameter, checked by emulate.py against the Python arguments:
// "p<k><size>" for a pointer to writable memory, "c<k><size>" for a pointer to const,
// "v<k><size>" for a value; <k> is f (floating), i (signed), u (unsigned), h (__half),
// b (__nv_bfloat16) or x (anything else).
template <class T>
inline std::string type_code_of() {
    if constexpr (std::is_same_v<T, __half>) return "h2";
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return "b2";
    else if constexpr (std::is_floating_point_v<T>) return "f" + std::to_string(sizeof(T));
    else if constexpr (std::is_same_v<T, bool>) return "x1";
    else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) return "i" + std::to_string(sizeof(T));
    else if constexpr (std::is_integral_v<T>) return "u" + std::to_string(sizeof(T));
    else if constexpr (std::is_void_v<T>) return "x0";
    else return "x" + std::to_string(sizeof(T));
}
template <class A>
inline std::string param_code() {
    using T = std::remove_cv_t<A>;
    if constexpr (std::is_pointer_v<T>) {
        using P = std::remove_pointer_t<T>;
        return (std::is_const_v<P> ? "c" : "p") + type_code_of<std::remove_cv_t<P>>();
    } else {
        return "v" + type_code_of<T>();
    }
}
template <class... A>
inline const char* signature(void (*)(A...)) {
    static const std::string s = [] {
        std::string out;
        ((out += param_code<A>() + ","), ...);
        return out;
    }();
    return s.c_str();
}

template <class... A>
inline int launch(void (*f)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                  unsigned by, unsigned bz, size_t smem, void** args) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_last_error[0] = 0;
    struct Ctx { void (*f)(A...); void** args; } ctx{f, args};
    Body body = [](void* p) {
        auto* c = static_cast<Ctx*>(p);
        invoke(c->f, c->args, std::index_sequence_for<A...>{});
    };
    void* dyn = nullptr;
    if (smem) {
        dyn = std::aligned_alloc(128, (smem + 127) / 128 * 128);
        if (!dyn) {
            std::snprintf(g_last_error, sizeof g_last_error, "cannot allocate %zu bytes of dynamic shared memory", smem);
            return 1;
        }
    }
    g_dynamic_shared = dyn;
    g_dynamic_shared_bytes = smem;
    const int rc = launch_impl(body, &ctx, dim3(gx, gy, gz), dim3(bx, by, bz));
    g_dynamic_shared = nullptr;
    g_dynamic_shared_bytes = 0;
    std::free(dyn);
    return rc;
}

}  // namespace cuemu

extern "C" __attribute__((visibility("default"), used)) const char* cuemu_last_error() {
    return cuemu::g_last_error;
}
