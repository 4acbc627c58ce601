/* Internal to the C sources (not part of cffi's cdef): the CPU's feature bits, asked of cpuid
 * once per process. See [Note: cpuid asked once] in cpu_features.c.
 */
#ifndef DS_NATIVE_CPUID_CACHE_H
#define DS_NATIVE_CPUID_CACHE_H

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
/* ECX of cpuid leaf `leaf` (sub-leaf 0): 0 where the CPU has no such leaf. Leaves 0-7 only (the
 * feature leaves); any other leaf gives 0. */
unsigned int ds_native_cpuid_ecx(unsigned int leaf);
#endif

#endif /* DS_NATIVE_CPUID_CACHE_H */
