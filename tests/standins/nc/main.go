// nc stands in for netcat-openbsd, which upstream's agnhost image (alpine) carries: the
// networking specs run `echo hostName | nc -w 1 -u IP PORT` from a host-network agnhost pod and
// read the UDP reply. Debian's busybox nc has no -u. Client mode only:
//
//	nc [-u] [-w SECS] [-v] [-z] HOST PORT
//
// stdin is sent, what comes back goes to stdout. -w: connect timeout, and how long to wait for
// more data once stdin is done (then exit 0, as netcat-openbsd does). -z: connect and exit.
package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"
)

func die(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "nc: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	udp, scan, verbose := false, false, false
	wait := time.Duration(0)
	var pos []string
	args := os.Args[1:]
	for i := 0; i < len(args); i++ {
		a := args[i]
		if len(a) < 2 || a[0] != '-' {
			pos = append(pos, a)
			continue
		}
		// Flags may be grouped (-uv) and -w may carry its value (-w1).
		for j := 1; j < len(a); j++ {
			switch a[j] {
			case 'u':
				udp = true
			case 'z':
				scan = true
			case 'v':
				verbose = true
			case 'n', 'q', 'N':
				// no DNS / quit-after-EOF variants: the defaults here already behave so
			case 'w':
				v := a[j+1:]
				if v == "" {
					i++
					if i >= len(args) {
						die("-w needs a value")
					}
					v = args[i]
				}
				secs, err := strconv.Atoi(v)
				if err != nil || secs < 0 {
					die("bad -w value %q", v)
				}
				wait = time.Duration(secs) * time.Second
				j = len(a)
			default:
				die("unsupported option -%c", a[j])
			}
		}
	}
	if len(pos) != 2 {
		die("usage: nc [-u] [-w SECS] [-v] [-z] HOST PORT")
	}
	network := "tcp"
	if udp {
		network = "udp"
	}
	addr := net.JoinHostPort(pos[0], pos[1])
	d := net.Dialer{Timeout: wait}
	conn, err := d.Dial(network, addr)
	if err != nil {
		die("connect to %s (%s): %v", addr, network, err)
	}
	defer conn.Close()
	if verbose {
		fmt.Fprintf(os.Stderr, "Connection to %s %s port [%s] succeeded!\n", pos[0], pos[1], network)
	}
	if scan {
		return
	}
	sent := make(chan struct{})
	go func() {
		buf := make([]byte, 64*1024)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				// One datagram per read, as netcat sends a line piped in.
				if _, werr := conn.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		if tc, ok := conn.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		close(sent)
	}()
	buf := make([]byte, 64*1024)
	stdinDone := false
	for {
		if !stdinDone {
			select {
			case <-sent:
				stdinDone = true
			default:
			}
		}
		// Without -w: read until the peer closes (TCP) or forever (UDP), as netcat does.
		if wait > 0 && stdinDone {
			_ = conn.SetReadDeadline(time.Now().Add(wait))
		} else if wait > 0 {
			_ = conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		}
		n, err := conn.Read(buf)
		if n > 0 {
			os.Stdout.Write(buf[:n])
		}
		if err == nil {
			continue
		}
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			if stdinDone {
				return
			}
			continue
		}
		if err == io.EOF {
			return
		}
		// A refused UDP port shows as a read error: nothing came back.
		return
	}
}
