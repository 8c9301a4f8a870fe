# ff-clone: one guest process that makes a restored clone distinct and current.
# Reads a 416-byte record from stdin (the host writes it through guest-exec input-data):
#   [0,208)   struct timex: modes = ADJ_SETOFFSET, time = host-minus-guest clock offset (s, us)
#   [208,272) 64 bytes of host entropy, written to /dev/urandom (mixed into the input pool)
#   [272,280) u64 hostname length, [280,344) hostname
#   [344,352) u64 sandbox-id length, [352,416) sandbox id (with trailing newline)
# then: clock_adjtime(CLOCK_REALTIME) (a relative step, so exec latency does not matter),
# write entropy + ioctl(RNDRESEEDCRNG), sethostname, mkdir /run/forkfleet, write sandbox-id.
# Exit status 0 on success, 10..17 names the step that failed.
# Assemble: as --64 -o ff-clone.o ff-clone.S && ld -s -N --build-id=none -o ff-clone ff-clone.o
        .intel_syntax noprefix
        .globl _start
        .text
_start:
        sub rsp, 512
        xor ebx, ebx
1:      xor eax, eax                    # read(0, rsp+got, 416-got)
        xor edi, edi
        lea rsi, [rsp+rbx]
        mov edx, 416
        sub edx, ebx
        syscall
        test rax, rax
        jle 2f
        add ebx, eax
        cmp ebx, 416
        jb 1b
2:      mov edi, 10
        cmp ebx, 416
        jne die
        mov eax, 305                    # clock_adjtime(CLOCK_REALTIME, &timex)
        xor edi, edi
        mov rsi, rsp
        syscall
        mov edi, 11
        test rax, rax
        js die
        mov eax, 2                      # open("/dev/urandom", O_WRONLY)
        lea rdi, [rip+urandom]
        mov esi, 1
        xor edx, edx
        syscall
        mov edi, 12
        test eax, eax
        js die
        mov r12d, eax
        mov eax, 1                      # write(fd, entropy, 64)
        mov edi, r12d
        lea rsi, [rsp+208]
        mov edx, 64
        syscall
        mov edi, 13
        cmp rax, 64
        jne die
        mov eax, 16                     # ioctl(fd, RNDRESEEDCRNG, 0)
        mov edi, r12d
        mov esi, 0x5207
        xor edx, edx
        syscall
        mov edi, 14
        test rax, rax
        js die
        mov eax, 170                    # sethostname(name, len)
        lea rdi, [rsp+280]
        mov rsi, [rsp+272]
        syscall
        mov edi, 15
        test rax, rax
        js die
        mov eax, 83                     # mkdir("/run/forkfleet", 0755), EEXIST is fine
        lea rdi, [rip+rundir]
        mov esi, 493
        syscall
        mov eax, 2                      # open(sandbox-id, O_WRONLY|O_CREAT|O_TRUNC, 0644)
        lea rdi, [rip+sbfile]
        mov esi, 0x241
        mov edx, 420
        syscall
        mov edi, 16
        test eax, eax
        js die
        mov edi, eax                    # write(fd, id, len)
        mov eax, 1
        lea rsi, [rsp+352]
        mov rdx, [rsp+344]
        syscall
        mov edi, 17
        cmp rax, [rsp+344]
        jne die
        xor edi, edi
die:    mov eax, 60                     # exit(edi)
        syscall
urandom: .asciz "/dev/urandom"
rundir:  .asciz "/run/forkfleet"
sbfile:  .asciz "/run/forkfleet/sandbox-id"
