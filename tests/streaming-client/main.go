// A streaming client built on client-go's remotecommand and portforward packages, the code
// crictl and kubelet's callers use, for tests/streaming.rs: it takes the URL that Exec,
// Attach or PortForward would return, so the server can be tested without a CRI runtime.
//
//	streaming-client exec [-ws] [-tty] [-stdin] [-resize 80x24,100x30] [-proto V] [-insecure] URL
//	streaming-client portforward [-ws] [-insecure] URL LOCAL:REMOTE
//
// exec exits with the remote command's exit code (125 on a stream error, printed).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/client-go/util/exec"
	streamhttp "k8s.io/streaming/pkg/httpstream"
)

type sizes struct {
	ch chan *remotecommand.TerminalSize
}

func (s sizes) Next() *remotecommand.TerminalSize { return <-s.ch }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: streaming-client exec|portforward ...")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "exec":
		os.Exit(execCmd(os.Args[2:]))
	case "portforward":
		os.Exit(portForward(os.Args[2:]))
	}
	os.Exit(2)
}

func execCmd(args []string) int {
	fs := flag.NewFlagSet("exec", flag.ExitOnError)
	ws := fs.Bool("ws", false, "WebSocket instead of SPDY")
	tty := fs.Bool("tty", false, "TTY")
	stdin := fs.Bool("stdin", false, "send stdin")
	resize := fs.String("resize", "", "terminal sizes to send, WxH,...")
	proto := fs.String("proto", "", "offer only this protocol version (default: client-go's list)")
	insecure := fs.Bool("insecure", false, "HTTPS without verifying the server (as critest)")
	fs.Parse(args)
	u, err := url.Parse(fs.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 125
	}
	config := &rest.Config{TLSClientConfig: rest.TLSClientConfig{Insecure: *insecure}}
	var e remotecommand.Executor
	switch {
	case *ws && *proto != "":
		e, err = remotecommand.NewWebSocketExecutorForProtocols(config, "GET", u.String(), *proto)
	case *ws:
		e, err = remotecommand.NewWebSocketExecutor(config, "GET", u.String())
	case *proto != "":
		tr, up, rerr := spdy.RoundTripperFor(config)
		if rerr != nil {
			fmt.Fprintln(os.Stderr, rerr)
			return 125
		}
		e, err = remotecommand.NewSPDYExecutorForProtocols(tr, up, "POST", u, *proto)
	default:
		e, err = remotecommand.NewSPDYExecutor(config, "POST", u)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 125
	}
	opts := remotecommand.StreamOptions{Stdout: os.Stdout, Tty: *tty}
	if !*tty {
		opts.Stderr = os.Stderr
	}
	if *stdin {
		opts.Stdin = os.Stdin
	}
	if *resize != "" {
		q := sizes{make(chan *remotecommand.TerminalSize, 16)}
		for _, s := range strings.Split(*resize, ",") {
			var w, h uint16
			fmt.Sscanf(s, "%dx%d", &w, &h)
			q.ch <- &remotecommand.TerminalSize{Width: w, Height: h}
		}
		opts.TerminalSizeQueue = q
	}
	err = e.StreamWithContext(context.Background(), opts)
	var exitErr exec.ExitError
	if errors.As(err, &exitErr) && exitErr.Exited() {
		return exitErr.ExitStatus()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "stream error:", err)
		return 125
	}
	return 0
}

func portForward(args []string) int {
	fs := flag.NewFlagSet("portforward", flag.ExitOnError)
	ws := fs.Bool("ws", false, "SPDY tunnelled in WebSocket instead of SPDY")
	insecure := fs.Bool("insecure", false, "HTTPS without verifying the server (kubelet's self-signed port)")
	fs.Parse(args)
	u, err := url.Parse(fs.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 125
	}
	config := &rest.Config{TLSClientConfig: rest.TLSClientConfig{Insecure: *insecure}}
	var dialer streamhttp.Dialer
	if *ws {
		dialer, err = portforward.NewSPDYOverWebsocketDialerForStreaming(u, config)
	} else {
		var tr http.RoundTripper
		var up spdy.Upgrader
		tr, up, err = spdy.RoundTripperFor(config)
		if err == nil {
			dialer = spdy.NewDialerForStreaming(up, &http.Client{Transport: tr}, "POST", u)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 125
	}
	// As crictl port-forward: ports LOCAL:REMOTE on 127.0.0.1; "ready" once listening.
	ready := make(chan struct{})
	go func() {
		<-ready
		fmt.Println("ready")
	}()
	pf, err := portforward.NewForStreaming(dialer, []string{fs.Arg(1)}, make(chan struct{}), ready, os.Stderr, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 125
	}
	if err := pf.ForwardPorts(); err != nil {
		fmt.Fprintln(os.Stderr, "forward error:", err)
		return 125
	}
	return 0
}
